//! `hostile`: a test guest that attacks its node from every callback and
//! through every import, for the hostile-guest suite (`tests/all/hostile.rs`,
//! contract §5 row 10). Each attack must be contained — the key killed or
//! refused with a clear error — while the node and other keys keep serving.
//!
//! Commands sent with `handle-call` (UTF-8 text):
//!
//! | command                  | behaviour                                                   |
//! |--------------------------|-------------------------------------------------------------|
//! | `ping`                   | replies `pong`                                              |
//! | `loop`                   | loops forever in `handle-call`                              |
//! | `loop-timer`             | arms a 1 ms timer tagged `loop`, replies `armed`; `handle-info` then loops forever |
//! | `rearm-zero`             | arms a 0 ms timer tagged `rearm`, replies `armed`; each time it fires, `handle-info` counts it and arms it again at 0 ms, forever (a key that keeps its node busy with short callbacks) |
//! | `fired`                  | replies how many `rearm` timers have fired                  |
//! | `memory`                 | allocates and keeps 1 MiB chunks forever                    |
//! | `handles`                | creates WASI pollables and never drops them, forever (a handle-table bomb); replies the error if one comes |
//! | `recurse`                | recurses without bound                                      |
//! | `reply <n>`              | replies `n` bytes of `x`                                    |
//! | `timers`                 | arms 1-hour timers until refused; replies `<count> <error>` |
//! | `big-timers <n>`         | arms 1-hour timers with `n`-byte tags until refused; replies `<count> <error>` |
//! | `timer-flood <n>`        | arms `n` 0 ms timers tagged `dropped`, then blocks 1 s (its mailbox fills, the rest are dropped); replies how many it armed |
//! | `sleep <ms>`             | blocks (a WASI pollable, no CPU) for `ms` milliseconds; replies `slept` |
//! | `publish-flood`          | publishes to `hostile:flood` until refused; replies `<count> <error>` |
//! | `call-self`              | calls itself; replies `error: <CallError>` or the reply      |
//! | `call <module> <key> <msg...>` | calls that key (1 s timeout); replies its reply or `error: <CallError>` |
//! | `preopens`               | replies the number of directories WASI preopened for it    |
//! | `read <path>`            | replies the file's bytes or `error: <io error>`             |
//! | `write <path> <text>`    | writes the file; replies `ok` or `error: <io error>`        |
//! | `tcp <ip:port>`          | asks WASI for a TCP socket and connects; replies `connected` or `error: <code>` |
//! | `udp`                    | asks WASI for a UDP socket; replies `created` or `error: <code>` |
//! | `lookup <name>`          | asks WASI to resolve a name; replies `resolved` or `error: <code>` |
//! | `log <n> [times]`        | logs one line of `n` bytes of `l` at info level, `times` times (default 1, the same string each time); replies `ok` |
//! | `log-lines <count>`      | logs `count` short lines at info level; replies `ok`         |
//! | `print <n> [times]`      | writes `n` bytes of `p` to stdout with no newline, `times` times, then one newline; replies `ok` |
//! | `print-lines <count>`    | writes `count` short lines to stdout; replies `ok`           |
//! | `error <n>`              | fails `handle-call` with an error of `n` bytes of `e`        |
//!
//! Casts: `loop` loops forever in `handle-cast`. Keys named `loop-init...`
//! loop forever in `init`, keys named `loop-terminate...` in `terminate`;
//! keys named `refuse-init-<n>...` refuse `init` with `n` bytes of `r`;
//! keys named `slow-terminate...` put `yes` in cache namespace `terminating`
//! under their name in `terminate`, then block for 1.5 s.
//! `handle-fence` loops forever (only called when the module is deployed
//! with `on_fence = callback`), except for keys named `fence-stop-<n>...`,
//! which stop with a reason of `n` bytes of `s`; `terminate` then logs
//! `terminate: fenced, <len> bytes` with the length of the reason it got.

use core::hint::black_box;
use core::time::Duration;

use fief_guest::{FenceDecision, Info, Key, StopReason, export_key, host};

/// The size of one `memory` allocation.
const CHUNK_BYTES: usize = 1 << 20;

/// Loops forever, doing work the optimizer cannot remove.
fn spin_forever() -> ! {
    let mut turns: u64 = 0;
    loop {
        turns = black_box(turns.wrapping_add(1));
    }
}

/// Recurses until the stack runs out.
#[inline(never)]
fn recurse(depth: u64) -> u64 {
    let frame = black_box([depth; 16]);
    if black_box(depth) == u64::MAX {
        return frame[0];
    }
    recurse(black_box(depth + 1)).wrapping_add(frame[15])
}

/// The attacker; keeps what it hoards so none of it is freed.
struct Hostile {
    /// Memory kept by `memory`.
    hoard: Vec<Vec<u8>>,
    /// Handles kept by `handles`.
    handles: Vec<wasip2::io::poll::Pollable>,
    /// The key's name (for `terminate`).
    key: String,
    /// `rearm` timers fired so far.
    fired: u64,
}

impl Hostile {
    fn arm_timers() -> String {
        let mut armed: u64 = 0;
        loop {
            match host::send_after(Duration::from_secs(3600), b"flood") {
                Ok(_) => armed += 1,
                Err(error) => return format!("{armed} {error}"),
            }
        }
    }

    /// Arm hour-long timers with `size`-byte tags until the host refuses.
    fn arm_big_timers(size: usize) -> String {
        let tag = vec![b't'; size];
        let mut armed: u64 = 0;
        loop {
            match host::send_after(Duration::from_secs(3600), &tag) {
                Ok(_) => armed += 1,
                Err(error) => return format!("{armed} {error}"),
            }
        }
    }

    fn flood() -> String {
        let mut published: u64 = 0;
        loop {
            match host::publish("hostile:flood", b"x") {
                Ok(_) => published += 1,
                Err(error) => return format!("{published} {error}"),
            }
        }
    }

    fn hoard_handles(&mut self) -> String {
        loop {
            let pollable = wasip2::clocks::monotonic_clock::subscribe_duration(3_600_000_000_000);
            self.handles.push(pollable);
        }
    }

    fn tcp(target: &str) -> String {
        use wasip2::sockets::network::{IpAddressFamily, IpSocketAddress, Ipv4SocketAddress};
        let Some((ip, port)) = target.rsplit_once(':') else {
            return format!("error: expected ip:port, got {target:?}");
        };
        let octets: Vec<u8> = ip.split('.').filter_map(|o| o.parse().ok()).collect();
        let (Ok(port), &[a, b, c, d]) = (port.parse::<u16>(), &octets[..]) else {
            return format!("error: expected ip:port, got {target:?}");
        };
        let socket =
            match wasip2::sockets::tcp_create_socket::create_tcp_socket(IpAddressFamily::Ipv4) {
                Ok(socket) => socket,
                Err(code) => return format!("error: {code:?}"),
            };
        let network = wasip2::sockets::instance_network::instance_network();
        let address = IpSocketAddress::Ipv4(Ipv4SocketAddress {
            port,
            address: (a, b, c, d),
        });
        if let Err(code) = socket.start_connect(&network, address) {
            return format!("error: {code:?}");
        }
        socket.subscribe().block();
        match socket.finish_connect() {
            Ok(_) => "connected".to_owned(),
            Err(code) => format!("error: {code:?}"),
        }
    }

    fn udp() -> String {
        use wasip2::sockets::network::IpAddressFamily;
        match wasip2::sockets::udp_create_socket::create_udp_socket(IpAddressFamily::Ipv4) {
            Ok(_) => "created".to_owned(),
            Err(code) => format!("error: {code:?}"),
        }
    }

    fn lookup(name: &str) -> String {
        let network = wasip2::sockets::instance_network::instance_network();
        match wasip2::sockets::ip_name_lookup::resolve_addresses(&network, name) {
            Ok(_) => "resolved".to_owned(),
            Err(code) => format!("error: {code:?}"),
        }
    }
}

/// `Ok(text)` or `error: <e>` as the reply.
fn reply_or_error<T, E: core::fmt::Display>(
    result: Result<T, E>,
    ok: impl FnOnce(T) -> Vec<u8>,
) -> Vec<u8> {
    match result {
        Ok(value) => ok(value),
        Err(e) => format!("error: {e}").into_bytes(),
    }
}

/// The number after `prefix` in `key` (up to the next `-`), if `key`
/// starts with it.
fn size_in(key: &str, prefix: &str) -> Option<usize> {
    let rest = key.strip_prefix(prefix)?;
    rest.split('-').next()?.parse().ok()
}

/// `n` and `times` from `"<n> [times]"`.
fn size_and_times(args: &str) -> Result<(usize, usize), String> {
    let mut parts = args.split(' ');
    let n = parts.next().and_then(|n| n.parse().ok());
    let times = parts.next().map_or(Some(1), |t| t.parse().ok());
    match (n, times) {
        (Some(n), Some(times)) => Ok((n, times)),
        _ => Err(format!("hostile: expected <n> [times], got {args:?}")),
    }
}

impl Key for Hostile {
    fn init(key: &str, _handoff: Option<Vec<u8>>) -> Result<Self, String> {
        if key.starts_with("loop-init") {
            spin_forever();
        }
        if let Some(n) = size_in(key, "refuse-init-") {
            return Err("r".repeat(n));
        }
        Ok(Hostile {
            hoard: Vec::new(),
            handles: Vec::new(),
            key: key.to_owned(),
            fired: 0,
        })
    }

    fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String> {
        let text = String::from_utf8_lossy(&message).into_owned();
        let (command, args) = text.split_once(' ').unwrap_or((&text, ""));
        Ok(match command {
            "ping" => b"pong".to_vec(),
            "loop" => spin_forever(),
            "rearm-zero" => {
                host::send_after(Duration::ZERO, b"rearm").map_err(|e| e.to_string())?;
                b"armed".to_vec()
            }
            "fired" => self.fired.to_string().into_bytes(),
            "loop-timer" => {
                host::send_after(Duration::from_millis(1), b"loop").map_err(|e| e.to_string())?;
                b"armed".to_vec()
            }
            "memory" => loop {
                self.hoard.push(black_box(vec![0xA5_u8; CHUNK_BYTES]));
            },
            "handles" => self.hoard_handles().into_bytes(),
            "recurse" => recurse(0).to_string().into_bytes(),
            "reply" => {
                let n: usize = args
                    .parse()
                    .map_err(|_| format!("hostile: reply needs a byte count, got {args:?}"))?;
                vec![b'x'; n]
            }
            "timers" => Self::arm_timers().into_bytes(),
            "big-timers" => match args.parse() {
                Ok(size) => Self::arm_big_timers(size).into_bytes(),
                Err(_) => format!("hostile: expected a tag size, got {args:?}").into_bytes(),
            },
            "timer-flood" => {
                let n: u64 = args.parse().unwrap_or(0);
                let mut armed: u64 = 0;
                while armed < n && host::send_after(Duration::ZERO, b"dropped").is_ok() {
                    armed += 1;
                }
                wasip2::clocks::monotonic_clock::subscribe_duration(1_000_000_000).block();
                armed.to_string().into_bytes()
            }
            // Block (not spin) for `args` milliseconds: the key is busy and
            // its mailbox fills.
            "sleep" => {
                let ms: u64 = args.parse().unwrap_or(0);
                wasip2::clocks::monotonic_clock::subscribe_duration(ms * 1_000_000).block();
                b"slept".to_vec()
            }
            "publish-flood" => Self::flood().into_bytes(),
            "call-self" => {
                let (module, key) = (host::self_module(), host::self_key());
                reply_or_error(
                    host::call(&module, &key, b"ping", Duration::from_secs(1)),
                    |r| r,
                )
            }
            "call" => {
                let mut parts = args.splitn(3, ' ');
                let (Some(module), Some(key), Some(msg)) =
                    (parts.next(), parts.next(), parts.next())
                else {
                    return Err(format!(
                        "hostile: expected call <module> <key> <msg>, got {args:?}"
                    ));
                };
                reply_or_error(
                    host::call(module, key, msg.as_bytes(), Duration::from_secs(1)),
                    |r| r,
                )
            }
            "preopens" => wasip2::filesystem::preopens::get_directories()
                .len()
                .to_string()
                .into_bytes(),
            "read" => reply_or_error(std::fs::read(args), |bytes| bytes),
            "write" => {
                let (path, body) = args.split_once(' ').unwrap_or((args, ""));
                reply_or_error(std::fs::write(path, body), |()| b"ok".to_vec())
            }
            "tcp" => Self::tcp(args).into_bytes(),
            "udp" => Self::udp().into_bytes(),
            "lookup" => Self::lookup(args).into_bytes(),
            "log" => {
                let (n, times) = size_and_times(args)?;
                let line = "l".repeat(n);
                for _ in 0..times {
                    host::log::info(black_box(&line));
                }
                b"ok".to_vec()
            }
            "log-lines" => {
                let count: usize = args.parse().map_err(|_| format!("hostile: {args:?}"))?;
                for i in 0..count {
                    host::log::info(&format!("hostile line {i}"));
                }
                b"ok".to_vec()
            }
            "print" => {
                use std::io::Write;
                let (n, times) = size_and_times(args)?;
                let bytes = vec![b'p'; n];
                let mut out = std::io::stdout().lock();
                for _ in 0..times {
                    out.write_all(black_box(&bytes))
                        .map_err(|e| e.to_string())?;
                }
                out.write_all(b"\n").map_err(|e| e.to_string())?;
                out.flush().map_err(|e| e.to_string())?;
                b"ok".to_vec()
            }
            "print-lines" => {
                let count: usize = args.parse().map_err(|_| format!("hostile: {args:?}"))?;
                for i in 0..count {
                    println!("hostile stdout line {i}");
                }
                b"ok".to_vec()
            }
            "error" => {
                let n: usize = args.parse().map_err(|_| format!("hostile: {args:?}"))?;
                return Err("e".repeat(n));
            }
            _ => {
                return Err(format!(
                    "hostile: unknown message {text:?}; see the crate's documentation"
                ));
            }
        })
    }

    fn handle_cast(&mut self, message: Vec<u8>) {
        if message == b"loop" {
            spin_forever();
        }
    }

    fn handle_info(&mut self, info: Info) {
        let Info::Timer(fired) = info else {
            return;
        };
        if fired.tag == b"loop" {
            spin_forever();
        }
        if fired.tag == b"rearm" {
            self.fired += 1;
            // Refused only when the key is going away.
            let _ = host::send_after(Duration::ZERO, b"rearm");
        }
    }

    fn handle_fence(&mut self, _deadline_ms: u32) -> FenceDecision {
        if let Some(n) = size_in(&self.key, "fence-stop-") {
            return FenceDecision::Stop("s".repeat(n));
        }
        spin_forever()
    }

    fn terminate(&mut self, reason: StopReason) {
        if self.key.starts_with("loop-terminate") {
            spin_forever();
        }
        if self.key.starts_with("slow-terminate") {
            // Say so (the test waits for it), then take a while.
            let _ = fief_guest::cache::put(
                "terminating",
                &self.key,
                b"yes",
                None,
                fief_guest::cache::Write::Always,
            );
            wasip2::clocks::monotonic_clock::subscribe_duration(1_500_000_000).block();
        }
        if let StopReason::Fenced(why) = reason {
            host::log::info(&format!("terminate: fenced, {} bytes", why.len()));
        }
    }
}

export_key!(Hostile);
