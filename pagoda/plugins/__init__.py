"""pagoda's plugin system: hooks, the protocol and disconnect-policy interfaces, loading."""

from pagoda.plugins.hookspecs import hookimpl

__all__ = ["hookimpl"]
