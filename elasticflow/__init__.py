"""ElasticFlow: write model(), forward() and data(); the framework trains it."""
__version__ = "0.1.0"
