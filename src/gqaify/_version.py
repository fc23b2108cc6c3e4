"""The installed gqaify's version: one place, imported by the package's front door and by every record writer."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gqaify")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"
