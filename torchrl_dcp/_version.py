"""The library's version, in a leaf module: the manifest records it without importing the package face.

Example:
    >>> from torchrl_dcp._version import __version__
    >>> __version__.count(".") >= 1
    True
"""

__version__ = "0.1.0"
