// `chat-js`: examples/chat in JavaScript — a chat room per key, over
// WebSocket connections.
//
// Clients connect to `GET /v1/keys/chat-js/<room>/connect` on any node of the
// cluster. Every text frame a client sends is a message: the room keeps it
// (durably, in the key's storage) and sends it to every connection of the
// room, the sender's included, as a text frame. A client that connects gets
// the kept history first, one frame per message. Over HTTP:
//
// | kind | message       | effect                           | reply                               |
// |------|---------------|----------------------------------|-------------------------------------|
// | call | `history`     | none                             | the kept messages, `\n`-joined      |
// | call | `connections` | none                             | how many connections the room has   |
// | call | `say <text>`  | as if a client had sent `<text>` | how many connections it was sent to |
//
// The room keeps its last 100 messages under the storage entry `history` (a
// JSON array of strings, as the Rust `chat` keeps it: a module may be
// rewritten from one language to the other and keep its rooms), so the
// history survives the key's eviction, a move and a crash of its owner; the
// connections survive eviction and a graceful move (the node that accepted
// each holds it). A message is sent to each connection once, in the order the
// room took them. A binary frame closes its connection (4000, text frames
// only).
//
// Build: scripts/build-guest.sh examples/chat-js target/guests/chat_js.wasm

import { Key, Reject, connections, exportKey, host, storage } from '../../guest-sdk/js/fief.js';

/** How many messages a room keeps. */
const HISTORY = 100;

/** The storage entry holding the history. */
const ENTRY = 'history';

class Room extends Key {
  constructor(key, handoff) {
    super(key, handoff);
    /** The last `HISTORY` messages, oldest first. */
    this.history = [];
    let kept;
    try {
      kept = storage.get(ENTRY);
      if (kept !== undefined) kept = JSON.parse(host.text(kept));
    } catch (error) {
      throw new Reject(`chat: cannot read the history: ${error.message}`);
    }
    if (kept !== undefined) {
      if (!Array.isArray(kept) || !kept.every((m) => typeof m === 'string')) {
        throw new Reject('chat: cannot read the history: not a JSON array of strings');
      }
      this.history = kept;
    }
  }

  /** Keep `text` and send it to every connection; returns how many it was sent to. */
  say(text) {
    if (this.history.length === HISTORY) this.history.shift();
    this.history.push(text);
    try {
      storage.put(ENTRY, JSON.stringify(this.history));
    } catch (error) {
      throw new Reject(`chat: cannot keep the message: ${error.message}`);
    }
    let sent = 0;
    for (const id of connections.list()) {
      try {
        connections.sendText(id, text);
        sent += 1;
      } catch (error) {
        host.warn(`chat: connection ${id} missed a message: ${error.message}`);
      }
    }
    return sent;
  }

  handleCall(message) {
    const text = host.text(message);
    if (text === 'history') return this.history.join('\n');
    if (text === 'connections') return String(connections.list().length);
    if (text.startsWith('say ')) return String(this.say(text.slice('say '.length)));
    throw new Reject(`unknown message: ${text}; expected history, connections, say <text>`);
  }

  handleConnection(event) {
    switch (event.type) {
      case 'opened':
        if (event.resumed) return;
        for (const message of this.history) {
          try {
            connections.sendText(event.id, message);
          } catch {
            break;
          }
        }
        return;
      case 'text':
        try {
          this.say(event.text);
        } catch (error) {
          host.error(error.message);
        }
        return;
      case 'binary':
        connections.close(event.id, 4000, 'chat: text frames only');
        return;
      default: // 'closed': nothing to forget, the node keeps the list
    }
  }
}

export const lifecycle = exportKey(Room);
