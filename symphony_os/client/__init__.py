"""Clients of `symphony serve`: `client.py` (Client, AsyncClient over HTTP and WebSocket) and
`commands.py` (the `symphony upload/launch/ps/...` commands built on them)."""
from .client import AsyncClient, Client, ServerError

__all__ = ["AsyncClient", "Client", "ServerError"]
