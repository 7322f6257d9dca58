"""jaxshard's version: one place, read by the package, its command line and its report
page (and by hatch, for the wheel)."""

__version__ = "0.2.0"
