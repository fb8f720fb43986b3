"""`counter-py`: examples/counter in Python — one number per key.

Messages are UTF-8 text, exactly as for the Rust `counter`:

| kind | message           | effect                                             | reply     |
|------|-------------------|----------------------------------------------------|-----------|
| call | `incr`            | adds one                                           | new value |
| call | `get`             | none                                               | value     |
| cast | `tick-every <ms>` | adds one every `<ms>` ms (replaces an earlier one) | —         |
| cast | `stop-ticking`    | stops the ticking                                  | —         |

Values are decimal text and start at 0. A graceful handoff carries the value
to the next owner; ticking does not move with it (timers belong to the node
that armed them). A timer can fire just before it is cancelled and still be
queued, so a fired timer that is not the one currently armed is ignored.

Build: `scripts/build-guest.sh examples/counter-py target/guests/counter_py.wasm`.
"""

from fief_guest import EffectError, Key, Reject, export_key, host

TICK_TAG = b"tick"


class Counter(Key):
    def __init__(self, key, handoff):
        super().__init__(key, handoff)
        self.value = 0
        if handoff is not None:
            try:
                self.value = int(handoff.decode())
            except ValueError:
                raise Reject(f"counter: handoff state is not a decimal value: {handoff!r}")
        self.timer = None  # the armed ticking timer's id
        self.every = 0  # its period, ms

    def handle_call(self, message):
        if message == b"incr":
            if self.value >= 2**64 - 1:
                raise Reject("counter: value would overflow")
            self.value += 1
        elif message != b"get":
            text = message.decode(errors="replace")
            raise Reject(f"unknown message: {text}; expected incr, get")
        return str(self.value)

    def handle_cast(self, message):
        text = message.decode(errors="replace")
        if text == "stop-ticking":
            self.stop_ticking()
        elif text.startswith("tick-every "):
            ms = text[len("tick-every "):].strip()
            if ms.isdigit() and int(ms) > 0:
                self.stop_ticking()
                self.start_ticking(int(ms))
            else:
                host.warn(f"counter: tick-every needs a positive number of milliseconds, got {ms!r}")
        else:
            host.warn(f"counter: unknown cast: {text}; expected tick-every <ms>, stop-ticking")

    def handle_timer(self, timer_id, tag):
        if timer_id != self.timer:
            return  # a timer cancelled after it fired: not the current ticker
        self.value = min(self.value + 1, 2**64 - 1)
        self.start_ticking(self.every)

    def handoff(self):
        return str(self.value)

    def stop_ticking(self):
        if self.timer is not None:
            host.cancel_timer(self.timer)
            self.timer = None

    def start_ticking(self, every):
        try:
            self.timer, self.every = host.send_after(every, TICK_TAG), every
        except EffectError as error:
            host.warn(f"counter: cannot arm tick timer: {error}")
            self.timer = None


Lifecycle = export_key(Counter)
