// `probe-js`: the JavaScript test guest — the JS SDK driven by text commands.
// It answers exactly the commands of `probe-py` (see tests/polyglot/probe-py/app.py):
// ping, whoami, echo, call, after, events, on-fence, fail, crash, spin,
// spin-after-call, cache-get, cache-put, cache-cas, cache-delete, store-put,
// store-get, store-list, store-del (`true` / `false` where Python says
// `True` / `False`). Its WebSocket connections echo as probe-py's do: each
// text frame back as text (`connections.sendText`), each binary frame as
// binary (`connections.sendBinary`).

import {
  CONTINUE,
  CacheError,
  CallError,
  EffectError,
  Key,
  Reject,
  StorageError,
  cache,
  connections,
  exportKey,
  host,
  stop,
  storage,
} from '../../../guest-sdk/js/fief.js';

function spinForever() {
  let turns = 0;
  for (;;) turns += 1;
}

class Probe extends Key {
  constructor(key, handoff) {
    super(key, handoff);
    this.events = [];
    this.fenceAnswer = stop('probe says stop');
  }

  handleCall(message) {
    const text = host.text(message);
    const space = text.indexOf(' ');
    const command = space < 0 ? text : text.slice(0, space);
    const rest = space < 0 ? '' : text.slice(space + 1);
    switch (command) {
      case 'ping':
        return 'pong';
      case 'whoami':
        return `${host.selfModule()}/${host.selfKey()}`;
      case 'echo':
        return rest;
      case 'call': {
        const [module = '', key = '', ...words] = rest.split(' ');
        try {
          return host.call(module, key, words.join(' '), 5000);
        } catch (error) {
          if (error instanceof CallError) return `error: ${error.message}`;
          throw error;
        }
      }
      case 'after': {
        const [ms, ...tag] = rest.split(' ');
        return String(host.sendAfter(Number(ms), tag.join(' ')));
      }
      case 'events':
        return this.events.join('\n');
      case 'on-fence':
        this.fenceAnswer = rest === 'continue' ? CONTINUE : stop('probe says stop');
        return 'ok';
      case 'fail':
        throw new Reject(rest);
      case 'crash':
        throw new Error('probe-js: crash on request');
      case 'spin':
        return spinForever();
      case 'spin-after-call': {
        const [module, key] = rest.split(' ');
        try {
          host.call(module, key, 'ping');
        } catch (error) {
          // the marker's reply does not matter
        }
        return spinForever();
      }
      case 'cache-get':
      case 'cache-put':
      case 'cache-cas':
      case 'cache-delete':
        try {
          return this.cacheCommand(command, rest.split(' '));
        } catch (error) {
          if (error instanceof CacheError) return `error: ${error.message}`;
          throw error;
        }
      case 'store-put':
      case 'store-get':
      case 'store-list':
      case 'store-del':
        try {
          return this.storeCommand(command, rest);
        } catch (error) {
          if (error instanceof StorageError) return `error: ${error.message}`;
          throw error;
        }
      default:
        throw new Reject(`probe-js: unknown command ${JSON.stringify(command)}`);
    }
  }

  storeCommand(command, rest) {
    switch (command) {
      case 'store-put': {
        const space = rest.indexOf(' ');
        storage.put(rest.slice(0, space), rest.slice(space + 1));
        return 'ok';
      }
      case 'store-get': {
        const value = storage.get(rest);
        return value === undefined ? 'none' : host.text(value);
      }
      case 'store-list':
        return storage
          .list(rest)
          .map(([name, value]) => `${name}=${host.text(value)}`)
          .join(',');
      default:
        return String(storage.delete(rest));
    }
  }

  cacheCommand(command, [namespace = '', key = '', ...words]) {
    switch (command) {
      case 'cache-get': {
        const entry = cache.get(namespace, key);
        return entry === undefined ? 'none' : `${entry.version} ${host.text(entry.value)}`;
      }
      case 'cache-put':
        return String(cache.put(namespace, key, words.join(' ')));
      case 'cache-cas': {
        const [version, ...value] = words;
        return String(cache.put(namespace, key, value.join(' '), { expectedVersion: version }));
      }
      default:
        return String(cache.delete(namespace, key));
    }
  }

  handleCast(message) {
    this.events.push(`cast:${host.text(message)}`);
  }

  handleTimer(id, tag) {
    this.events.push(`timer:${host.text(tag)}`);
  }

  handlePublication(topic, payload) {
    this.events.push(`pub:${topic}:${host.text(payload)}`);
  }

  handleFence(deadlineMs) {
    this.events.push(`fence:${deadlineMs}`);
    return this.fenceAnswer;
  }

  handleConnection(event) {
    // An echo; a send the host refuses (a full queue, a closed connection)
    // is dropped, as an echo server would.
    try {
      if (event.type === 'text') connections.sendText(event.id, event.text);
      else if (event.type === 'binary') connections.sendBinary(event.id, event.data);
    } catch (error) {
      if (!(error instanceof EffectError)) throw error;
    }
  }
}

export const lifecycle = exportKey(Probe);
