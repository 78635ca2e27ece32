"""Python clients for the streamasr wire protocol: blocking (`Client`) and asyncio (`AsyncClient`)."""

from client.aio import AsyncClient, AsyncStream
from client.client import Client, Stream, status
from client.core import NoCredit, ServerError, StreamError

__all__ = ["AsyncClient", "AsyncStream", "Client", "NoCredit", "Stream", "ServerError", "StreamError", "status"]
