// `counter-js`: examples/counter in JavaScript — one number per key.
//
// Messages are UTF-8 text, exactly as for the Rust `counter`:
//
// | kind | message           | effect                                             | reply     |
// |------|-------------------|----------------------------------------------------|-----------|
// | call | `incr`            | adds one                                           | new value |
// | call | `get`             | none                                               | value     |
// | cast | `tick-every <ms>` | adds one every `<ms>` ms (replaces an earlier one) | —         |
// | cast | `stop-ticking`    | stops the ticking                                  | —         |
//
// Values are decimal text and start at 0 (kept as a bigint: the Rust counter
// is a u64). A graceful handoff carries the value to the next owner; ticking
// does not move with it (timers belong to the node that armed them). A timer
// can fire just before it is cancelled and still be queued, so a fired timer
// that is not the one currently armed is ignored.
//
// Build: scripts/build-guest.sh examples/counter-js target/guests/counter_js.wasm

import { EffectError, Key, Reject, exportKey, host } from '../../guest-sdk/js/fief.js';

const MAX = 2n ** 64n - 1n;

class Counter extends Key {
  constructor(key, handoff) {
    super(key, handoff);
    this.value = 0n;
    if (handoff !== undefined) {
      const text = host.text(handoff);
      if (!/^[0-9]+$/.test(text) || BigInt(text) > MAX) {
        throw new Reject(`counter: handoff state is not a decimal value: ${JSON.stringify(text)}`);
      }
      this.value = BigInt(text);
    }
    this.timer = undefined; // the armed ticking timer's id
    this.every = 0; // its period, ms
  }

  handleCall(message) {
    const text = host.text(message);
    if (text === 'incr') {
      if (this.value >= MAX) throw new Reject('counter: value would overflow');
      this.value += 1n;
    } else if (text !== 'get') {
      throw new Reject(`unknown message: ${text}; expected incr, get`);
    }
    return String(this.value);
  }

  handleCast(message) {
    const text = host.text(message);
    if (text === 'stop-ticking') {
      this.stopTicking();
    } else if (text.startsWith('tick-every ')) {
      const ms = text.slice('tick-every '.length).trim();
      if (/^[0-9]+$/.test(ms) && Number(ms) > 0) {
        this.stopTicking();
        this.startTicking(Number(ms));
      } else {
        host.warn(`counter: tick-every needs a positive number of milliseconds, got ${JSON.stringify(ms)}`);
      }
    } else {
      host.warn(`counter: unknown cast: ${text}; expected tick-every <ms>, stop-ticking`);
    }
  }

  handleTimer(id, tag) {
    if (id !== this.timer) return; // a timer cancelled after it fired: not the current ticker
    if (this.value < MAX) this.value += 1n;
    this.startTicking(this.every);
  }

  handoff() {
    return String(this.value);
  }

  stopTicking() {
    if (this.timer !== undefined) {
      host.cancelTimer(this.timer);
      this.timer = undefined;
    }
  }

  startTicking(every) {
    try {
      this.timer = host.sendAfter(every, 'tick');
      this.every = every;
    } catch (error) {
      if (!(error instanceof EffectError)) throw error;
      host.warn(`counter: cannot arm tick timer: ${error.message}`);
      this.timer = undefined;
    }
  }
}

export const lifecycle = exportKey(Counter);
