"""The package's version, in a module of its own: modules that record it (``diagnostics``) import
it from here, never from the package they are part of."""

__version__ = "0.2.0"
