"""Python clients for the streamasr wire protocol: blocking (`Client`) and asyncio (`AsyncClient`),
and the events their streams yield."""

from client.aio import AsyncClient, AsyncStream
from client.client import Client, Stream, status
from client.core import NoCredit, ServerError, StreamError
from protocol.messages import Closed, ErrorMsg, Final, Partial

__all__ = ["AsyncClient", "AsyncStream", "Client", "Closed", "ErrorMsg", "Final", "NoCredit", "Partial", "Stream", "ServerError",
           "StreamError", "status"]
