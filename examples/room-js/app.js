// `room-js`: examples/room in JavaScript — chat rooms on pub/sub, one member
// per key.
//
// Key `<room>/<member>` is one member's view of the room `<room>` (the part of
// the key before its first `/`); a key with no `/` is in the room of its own
// name (`lobby` is in the room `lobby`, with `lobby/ann` and `lobby/bob`).
// When it starts, a key subscribes to the topic `room:<room>` and keeps the
// last 16 payloads published there (by any member — itself, or a key of
// another module in any language — included). Messages are UTF-8 text:
//
// | kind | message      | effect                              | reply                                   |
// |------|--------------|-------------------------------------|-----------------------------------------|
// | call | `get`        | none                                | the kept messages, `\n`-joined          |
// | call | `say <text>` | publishes `<text>` to `room:<room>` | how many subscribers it reached (below) |
//
// The members may live on any nodes of the cluster: a publication reaches the
// room's members on the speaker's node and is forwarded once to each other
// node with members, which gives it to its own. So `say`'s count is the
// members on this node that got it plus those each other node last said it
// had (a member that joined on another node a moment ago may not be counted,
// nor hear it, yet). Delivery is best effort: a member may miss a message,
// never get one twice.
//
// A key does not record its own `say` directly: it is subscribed to its
// room's topic, so the publication comes back through `handlePublication`
// like everyone else's, in the order the node delivered them. A graceful
// handoff passes the kept messages to the next owner as a JSON array of
// strings (the same state as the Rust `room`).
//
// Over HTTP, the `/` of a member's key is percent-encoded in the path
// (`POST /v1/keys/room-js/lobby%2Fann/call`); `fief call room-js lobby/ann get`
// does that itself.
//
// Build: scripts/build-guest.sh examples/room-js target/guests/room_js.wasm

import { Key, Reject, exportKey, host } from '../../guest-sdk/js/fief.js';

/** How many publications a room keeps. */
const HISTORY = 16;

/** The room `key` is in: the part before its first `/`, or the whole key if it has none. */
function roomOf(key) {
  const slash = key.indexOf('/');
  return slash === -1 ? key : key.slice(0, slash);
}

class Room extends Key {
  constructor(key, handoff) {
    super(key, handoff);
    this.topic = `room:${roomOf(key)}`;
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
