"""Strategies: what islands exchange and when. Each runs on the islands this process holds, through a Comm."""
