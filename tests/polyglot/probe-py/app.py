"""`probe-py`: the Python test guest — the Python SDK driven by text commands.

Each command is a `handle-call` message (UTF-8); `probe-js` answers the same:

| command                        | reply                                                      |
|--------------------------------|------------------------------------------------------------|
| `ping`                         | `pong`                                                     |
| `whoami`                       | `<module>/<key>`                                           |
| `echo <text>`                  | `<text>`                                                   |
| `call <module> <key> <msg...>` | the callee's reply (5 s timeout), or `error: <kind>[: <detail>]` |
| `after <ms> <tag>`             | the armed timer's id                                       |
| `events`                       | every event so far (`timer:<tag>`, `cast:<msg>`, `pub:<topic>:<payload>`, `fence:<ms>`), one per line |
| `on-fence continue` / `on-fence stop` | `ok`; sets the answer to `handle-fence`             |
| `fail <text>`                  | the error `<text>` (`rejected`)                             |
| `crash`                        | none: raises an exception that is not `Reject` (a trap)     |
| `spin`                         | none: loops forever                                         |
| `spin-after-call <module> <key>` | host-calls that key with `ping`, then loops forever      |
| `cache-get <ns> <key>`         | `<version> <value>`, `none`, or `error: <kind>[: <detail>]` |
| `cache-put <ns> <key> <value>` | the new version, or `error: ...`                            |
| `cache-cas <ns> <key> <version> <value>` | as `cache-put`, only if the version matches (0: if absent) |
| `cache-delete <ns> <key>`      | `True` if there was an entry, else `False`                   |
| `store-put <name> <value>`     | `ok`: stored in the key's durable state, or `error: ...`     |
| `store-get <name>`             | the stored value, or `none`                                  |
| `store-list <start>`           | `name=value` pairs from `start` on, comma-separated          |
| `store-del <name>`             | `True` if it was stored, else `False`                        |

Casts are recorded as events; publications too (`subscribe` is not a
command: the tests drive pub/sub with the Rust probe and the examples).

WebSocket connections (`GET /v1/keys/probe-py/<key>/connect`), as the Rust
probe: every text frame is sent back as a text frame to the connection it
came from, every binary frame as a binary frame (an echo, with
`connections.send_text` and `connections.send_binary`); opens and closes are
accepted. Connection events never appear in `events`.
"""

from fief_guest import (
    CONTINUE,
    CacheError,
    CallError,
    EffectError,
    Key,
    Reject,
    Stop,
    StorageError,
    cache,
    connections,
    export_key,
    host,
    storage,
)


def spin_forever():
    turns = 0
    while True:
        turns += 1


class Probe(Key):
    def __init__(self, key, handoff):
        super().__init__(key, handoff)
        self.events = []
        self.fence_answer = Stop("probe says stop")

    def handle_call(self, message):
        command, _, rest = message.decode(errors="replace").partition(" ")
        if command == "ping":
            return "pong"
        if command == "whoami":
            return f"{host.self_module()}/{host.self_key()}"
        if command == "echo":
            return rest
        if command == "call":
            module, key, text = (rest.split(" ", 2) + ["", ""])[:3]
            try:
                return host.call(module, key, text, timeout_ms=5000)
            except CallError as error:
                return f"error: {error}"
        if command == "after":
            ms, _, tag = rest.partition(" ")
            return str(host.send_after(int(ms), tag))
        if command == "events":
            return "\n".join(self.events)
        if command == "on-fence":
            self.fence_answer = CONTINUE if rest == "continue" else Stop("probe says stop")
            return "ok"
        if command == "fail":
            raise Reject(rest)
        if command == "crash":
            raise RuntimeError("probe-py: crash on request")
        if command == "spin":
            spin_forever()
        if command == "spin-after-call":
            module, _, key = rest.partition(" ")
            try:
                host.call(module, key, "ping")
            except CallError:
                pass
            spin_forever()
        if command.startswith("cache-"):
            try:
                return self.cache_command(command, rest)
            except CacheError as error:
                return f"error: {error}"
        if command.startswith("store-"):
            try:
                return self.store_command(command, rest)
            except StorageError as error:
                return f"error: {error}"
        raise Reject(f"probe-py: unknown command {command!r}")

    def store_command(self, command, rest):
        if command == "store-put":
            name, _, value = rest.partition(" ")
            storage.put(name, value)
            return "ok"
        if command == "store-get":
            value = storage.get(rest)
            return "none" if value is None else value.decode()
        if command == "store-list":
            return ",".join(f"{n}={v.decode()}" for n, v in storage.list_range(rest))
        if command == "store-del":
            return str(storage.delete(rest))
        raise Reject(f"probe-py: unknown command {command!r}")

    def cache_command(self, command, rest):
        if command == "cache-get":
            namespace, _, key = rest.partition(" ")
            entry = cache.get(namespace, key)
            return "none" if entry is None else f"{entry.version} {entry.value.decode()}"
        if command == "cache-put":
            namespace, key, value = (rest.split(" ", 2) + ["", ""])[:3]
            return str(cache.put(namespace, key, value))
        if command == "cache-cas":
            namespace, key, version, value = (rest.split(" ", 3) + ["", "", ""])[:4]
            return str(cache.put(namespace, key, value, expected_version=int(version)))
        if command == "cache-delete":
            namespace, _, key = rest.partition(" ")
            return str(cache.delete(namespace, key))
        raise Reject(f"probe-py: unknown command {command!r}")

    def handle_cast(self, message):
        self.events.append("cast:" + message.decode(errors="replace"))

    def handle_timer(self, timer_id, tag):
        self.events.append("timer:" + tag.decode(errors="replace"))

    def handle_publication(self, topic, payload):
        self.events.append(f"pub:{topic}:{payload.decode(errors='replace')}")

    def handle_fence(self, deadline_ms):
        self.events.append(f"fence:{deadline_ms}")
        return self.fence_answer

    def handle_connection(self, event):
        # An echo; a send the host refuses (a full queue, a closed
        # connection) is dropped, as an echo server would.
        try:
            if isinstance(event, connections.Text):
                connections.send_text(event.id, event.text)
            elif isinstance(event, connections.Binary):
                connections.send_binary(event.id, event.data)
        except EffectError:
            pass


Lifecycle = export_key(Probe)
