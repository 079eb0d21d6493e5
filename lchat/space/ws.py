"""WebSocket push: one RoomSocket per client, fanned out by a Hub keyed on room name."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from attrs import define, field, frozen
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.server import Request
from twisted.web.websocket import WebSocketTransport

from lchat.space.store import Message

log = Logger(namespace="lchat.space.ws")

# Posts a body to a room and pushes the stored message; raises ValueError for bad input.
Poster = Callable[[str, Any], Deferred[Message]]


def dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


@define(eq=False)
class RoomSocket:
    """The server side of one WebSocket (a twisted.web.websocket.WebSocketProtocol)."""

    room: str
    hub: Hub
    post: Poster
    transport: WebSocketTransport | None = None

    def negotiationStarted(self, transport: WebSocketTransport) -> None:
        self.transport = transport

    def negotiationFinished(self) -> None:
        self.hub.join(self)

    def send(self, obj: object) -> None:
        if self.transport is not None:
            self.transport.sendTextMessage(dumps(obj))

    def textMessageReceived(self, message: str) -> None:
        try:
            frame = json.loads(message)
        except ValueError:
            self.send({"error": "invalid JSON"})
            return
        if not isinstance(frame, dict):
            self.send({"error": "expected a JSON object"})
            return
        try:
            posted = self.post(self.room, frame.get("body"))
        except ValueError as e:
            self.send({"error": str(e)})
            return
        # Success needs no reply: the message comes back through the hub like everyone else's.
        posted.addErrback(self._post_failed)

    def _post_failed(self, failure: Failure) -> None:
        log.failure("post from websocket failed", failure)
        self.send({"error": "internal error"})

    def bytesMessageReceived(self, data: bytes | bytearray) -> None:
        self.send({"error": "send text frames"})

    def pongReceived(self, payload: bytes) -> None:
        pass

    def connectionLost(self, reason: Failure) -> None:
        self.transport = None
        self.hub.leave(self)


@frozen
class RoomSocketFactory:
    """A WebSocketServerFactory bound to one room."""

    room: str
    hub: Hub
    post: Poster

    def buildProtocol(self, request: Request) -> RoomSocket:
        return RoomSocket(self.room, self.hub, self.post)


@define
class Hub:
    _rooms: dict[str, set[RoomSocket]] = field(factory=dict)

    def join(self, sock: RoomSocket) -> None:
        self._rooms.setdefault(sock.room, set()).add(sock)

    def leave(self, sock: RoomSocket) -> None:
        members = self._rooms.get(sock.room)
        if members is not None:
            members.discard(sock)
            if not members:
                del self._rooms[sock.room]

    def publish(self, message: Message) -> None:
        text = dumps(message.to_json())
        for sock in list(self._rooms.get(message.room, ())):
            if sock.transport is not None:
                sock.transport.sendTextMessage(text)

    def close_all(self) -> None:
        """Close every socket with 1000 (normal closure); the server waits for the disconnects."""
        for members in list(self._rooms.values()):
            for sock in list(members):
                if sock.transport is not None:
                    sock.transport.loseConnection(1000)
