"""`chat-py`: examples/chat in Python — a chat room per key, over WebSocket
connections.

Clients connect to `GET /v1/keys/chat-py/<room>/connect` on any node of the
cluster. Every text frame a client sends is a message: the room keeps it
(durably, in the key's storage) and sends it to every connection of the
room, the sender's included, as a text frame. A client that connects gets
the kept history first, one frame per message. Over HTTP:

| kind | message       | effect                           | reply                               |
|------|---------------|----------------------------------|-------------------------------------|
| call | `history`     | none                             | the kept messages, `\\n`-joined      |
| call | `connections` | none                             | how many connections the room has   |
| call | `say <text>`  | as if a client had sent `<text>` | how many connections it was sent to |

The room keeps its last 100 messages under the storage entry `history` (a
JSON array of strings, as the Rust `chat` and `chat-js` keep it: a module may
be rewritten from one language to another and keep its rooms), so the
history survives the key's eviction, a move and a crash of its owner; the
connections survive eviction and a graceful move (the node that accepted
each holds it). A message is sent to each connection once, in the order the
room took them. A binary frame closes its connection (4000, text frames
only).

Build: `scripts/build-guest.sh examples/chat-py target/guests/chat_py.wasm`.
"""

import json

from fief_guest import EffectError, Key, Reject, StorageError, connections, export_key, host, storage

#: How many messages a room keeps.
HISTORY = 100

#: The storage entry holding the history.
ENTRY = "history"


def _encode(history):
    """The history as the Rust `chat` stores it: compact JSON, UTF-8."""
    return json.dumps(history, separators=(",", ":"), ensure_ascii=False)


class Room(Key):
    def __init__(self, key, handoff):
        super().__init__(key, handoff)
        #: The last `HISTORY` messages, oldest first.
        self.history = []
        try:
            kept = storage.get(ENTRY)
            if kept is not None:
                kept = json.loads(kept.decode())
        except (StorageError, ValueError) as error:
            raise Reject(f"chat: cannot read the history: {error}")
        if kept is not None:
            if not isinstance(kept, list) or not all(isinstance(m, str) for m in kept):
                raise Reject("chat: cannot read the history: not a JSON array of strings")
            self.history = kept

    def say(self, text):
        """Keep `text` and send it to every connection; returns how many it
        was sent to."""
        if len(self.history) == HISTORY:
            self.history.pop(0)
        self.history.append(text)
        try:
            storage.put(ENTRY, _encode(self.history))
        except StorageError as error:
            raise Reject(f"chat: cannot keep the message: {error}")
        sent = 0
        for conn_id in connections.list():
            try:
                connections.send_text(conn_id, text)
                sent += 1
            except EffectError as error:
                host.warn(f"chat: connection {conn_id} missed a message: {error}")
        return sent

    def handle_call(self, message):
        text = message.decode(errors="replace")
        if text == "history":
            return "\n".join(self.history)
        if text == "connections":
            return str(len(connections.list()))
        if text.startswith("say "):
            return str(self.say(text[len("say "):]))
        raise Reject(f"unknown message: {text}; expected history, connections, say <text>")

    def handle_connection(self, event):
        if isinstance(event, connections.Opened):
            if event.resumed:
                return
            for message in self.history:
                try:
                    connections.send_text(event.id, message)
                except EffectError:
                    break
        elif isinstance(event, connections.Text):
            try:
                self.say(event.text)
            except Reject as error:
                host.error(str(error))
        elif isinstance(event, connections.Binary):
            connections.close(event.id, 4000, "chat: text frames only")
        # Closed: nothing to forget, the node keeps the list.


Lifecycle = export_key(Room)
