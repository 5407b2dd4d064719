"""atoll: train language models across islands of compute joined by slow links."""

__version__ = "0.1.0"
