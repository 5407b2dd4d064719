"""Arithmetic about runs, no training: the cost projection to real scale and injected failure traces."""
