"""The version of the posttrain distribution (re-exported as ``posttrain.__version__``)."""

__version__ = "0.1.0"
