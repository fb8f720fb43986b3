// `room-js`: examples/room in JavaScript — a chat room per key, on pub/sub.
//
// Key `<name>` subscribes to the topic `room:<name>` when it starts and keeps
// the last 16 payloads published there (by anyone — itself, or a key of
// another module in any language — included). Messages are UTF-8 text:
//
// | kind | message      | effect                              | reply                          |
// |------|--------------|-------------------------------------|--------------------------------|
// | call | `get`        | none                                | the kept messages, `\n`-joined |
// | call | `say <text>` | publishes `<text>` to `room:<name>` | how many subscribers got it    |
//
// A key does not record its own `say` directly: it is subscribed to its own
// topic, so the publication comes back through `handlePublication` like
// everyone else's, in the order the node delivered them. A graceful handoff
// passes the kept messages to the next owner as a JSON array of strings (the
// same state as the Rust `room`).
//
// Build: scripts/build-guest.sh examples/room-js target/guests/room_js.wasm

import { Key, Reject, exportKey, host } from '../../guest-sdk/js/fief.js';

/** How many publications a room keeps. */
const HISTORY = 16;

class Room extends Key {
  constructor(key, handoff) {
    super(key, handoff);
    this.topic = `room:${key}`;
    this.messages = [];
    if (handoff !== undefined) {
      let kept;
      try {
        kept = JSON.parse(host.text(handoff));
      } catch (error) {
        throw new Reject(`room: bad handoff state: ${error.message}`);
      }
      if (!Array.isArray(kept)) throw new Reject('room: bad handoff state: not an array');
      kept.forEach((message) => this.remember(String(message)));
    }
    try {
      host.subscribe(this.topic);
    } catch (error) {
      throw new Reject(`room: cannot subscribe to ${this.topic}: ${error.message}`);
    }
  }

  remember(message) {
    if (this.messages.length === HISTORY) this.messages.shift();
    this.messages.push(message);
  }

  handleCall(message) {
    const text = host.text(message);
    if (text === 'get') return this.messages.join('\n');
    if (text.startsWith('say ')) {
      try {
        return String(host.publish(this.topic, text.slice('say '.length)));
      } catch (error) {
        throw new Reject(`room: cannot publish: ${error.message}`);
      }
    }
    throw new Reject(`unknown message: ${text}; expected get, say <text>`);
  }

  handlePublication(topic, payload) {
    if (topic === this.topic) this.remember(host.text(payload));
  }

  handoff() {
    return JSON.stringify(this.messages);
  }
}

export const lifecycle = exportKey(Room);
