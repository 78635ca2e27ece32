"""Python clients for the streamasr wire protocol: blocking (`Client`) and asyncio (`AsyncClient`)."""

from client.aio import AsyncClient, AsyncStream
from client.client import Client, Stream, status
from client.core import ServerError, StreamError

__all__ = ["AsyncClient", "AsyncStream", "Client", "Stream", "ServerError", "StreamError", "status"]
