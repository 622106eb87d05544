"""The server list of a map as both connection registries see it: SQL engines and MongoDB clients.

Both look servers up by name with the same error, pick the replica URL the same way, mask URLs
the same way, and adopt a new map's server list the same way; this is that one place.
"""

from __future__ import annotations

from collections.abc import Mapping

from mdb.errors import RoutingError
from mdb.partition_map import ServerSpec
from mdb.urls import mask_url

__all__ = ["ServerDirectory"]


class ServerDirectory:
    """Server name -> :class:`ServerSpec`, with the lookups every connection registry needs."""

    def __init__(self, servers: Mapping[str, ServerSpec]) -> None:
        self._servers: dict[str, ServerSpec] = dict(servers)

    def spec(self, server: str) -> ServerSpec:
        try:
            return self._servers[server]
        except KeyError:
            raise RoutingError(f"unknown server {server!r} (known: {', '.join(sorted(self._servers))})") from None

    def url(self, server: str, readonly: bool = False) -> str:
        """The URL a connection uses: the replica for readonly work when the map has one."""
        spec = self.spec(server)
        return spec.replica if readonly and spec.replica else spec.primary

    def masked_url(self, server: str, readonly: bool = False) -> str:
        return mask_url(self.url(server, readonly))

    def _adopt(self, servers: Mapping[str, ServerSpec]) -> set[str]:
        """Take a new server list; returns the URLs still in use (callers close the others)."""
        self._servers = dict(servers)
        return {s.primary for s in self._servers.values()} | {s.replica for s in self._servers.values() if s.replica}
