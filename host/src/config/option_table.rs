//! The table of module options: each option's name, meaning, parser,
//! default and bound, declared once in [`OPTIONS`]. Parsing an option
//! ([`ModuleOptions::set`]), parsing and checking the node's ceilings
//! ([`ModuleCeilings::set`], [`ModuleCeilings::check`]) and the CLI's help
//! (`fief deploy --help`, `fief node --help`, [`options_help`]) all read it,
//! so an option cannot be parsed without being described, nor capped
//! without the help saying so. It must not hold checks between options
//! (those are in `ModuleOptions::validate_for`).

use std::time::Duration;

use fief_core::OnFence;

use super::{ByteSize, CpuShare, DirGrant, ModuleCeilings, ModuleOptions};
use crate::error::{Error, Result};

/// One module option.
pub struct OptionSpec {
    /// The option's name, as in `--option NAME=VALUE` and the deploy's query.
    pub name: &'static str,
    /// What it does, in a line.
    pub meaning: &'static str,
    /// What bounds it: a node ceiling, or a fixed range.
    pub bound: Bound,
    set: fn(&mut ModuleOptions, &str) -> std::result::Result<(), String>,
    show: fn(&ModuleOptions) -> String,
}

/// What bounds an option.
pub enum Bound {
    /// A ceiling the node sets in `module_ceilings` (`--module-ceiling`).
    Ceiling(CeilingSpec),
    /// Another bound, in words (a node setting, a fixed range).
    Fixed(&'static str),
}

/// A node ceiling over one option.
pub struct CeilingSpec {
    show: fn(&ModuleCeilings) -> String,
    set: fn(&mut ModuleCeilings, &str) -> std::result::Result<(), String>,
    /// The option's value and the ceiling, if the option is over it.
    over: fn(&ModuleCeilings, &ModuleOptions) -> Option<(String, String)>,
    /// Set the option to the ceiling.
    lower: fn(&ModuleCeilings, &mut ModuleOptions),
}

impl OptionSpec {
    /// This option's value in `options`, as the help and listings write it.
    pub fn value(&self, options: &ModuleOptions) -> String {
        (self.show)(options)
    }

    /// The node ceiling over this option, if the node sets one.
    pub fn ceiling(&self) -> Option<&CeilingSpec> {
        match &self.bound {
            Bound::Ceiling(c) => Some(c),
            Bound::Fixed(_) => None,
        }
    }

    /// The bound in words, with `ceilings`' value where the node sets one.
    pub fn bound_text(&self, ceilings: &ModuleCeilings) -> String {
        match &self.bound {
            Bound::Ceiling(c) => format!("node ceiling {}", (c.show)(ceilings)),
            Bound::Fixed(text) => (*text).to_owned(),
        }
    }
}

/// The option named `name`.
pub fn find(name: &str) -> Option<&'static OptionSpec> {
    OPTIONS.iter().find(|o| o.name == name)
}

/// Every option's name, comma-separated (for "unknown option" errors).
pub fn option_names() -> String {
    OPTIONS
        .iter()
        .map(|o| o.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Every ceiling's name (the options the node caps), comma-separated.
pub fn ceiling_names() -> String {
    OPTIONS
        .iter()
        .filter(|o| o.ceiling().is_some())
        .map(|o| o.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Set option `name` of `options` from `value`.
pub(super) fn set_option(options: &mut ModuleOptions, name: &str, value: &str) -> Result<()> {
    let spec = find(name).ok_or_else(|| {
        Error::InvalidOptions(format!(
            "unknown option {name:?}; known options: {}",
            option_names()
        ))
    })?;
    (spec.set)(options, value)
        .map_err(|e| Error::InvalidOptions(format!("{name} = {value:?}: {e}")))
}

/// Set ceiling `name` of `ceilings` from `value`.
pub(super) fn set_ceiling(ceilings: &mut ModuleCeilings, name: &str, value: &str) -> Result<()> {
    let Some(ceiling) = find(name).and_then(OptionSpec::ceiling) else {
        return Err(Error::Config(format!(
            "unknown module ceiling {name:?}; known: {}",
            ceiling_names()
        )));
    };
    (ceiling.set)(ceilings, value)
        .map_err(|e| Error::Config(format!("module ceiling {name} = {value:?}: {e}")))
}

/// The first option of `options` over its ceiling in `ceilings`: its name,
/// value and the ceiling.
pub(super) fn first_over(
    ceilings: &ModuleCeilings,
    options: &ModuleOptions,
) -> Option<(&'static str, String, String)> {
    OPTIONS.iter().find_map(|o| {
        let c = o.ceiling()?;
        (c.over)(ceilings, options).map(|(value, ceiling)| (o.name, value, ceiling))
    })
}

/// Lower every option of `options` over its ceiling in `ceilings` to it;
/// returns each lowered option's name, value and ceiling.
pub(crate) fn lower_to_ceilings(
    ceilings: &ModuleCeilings,
    options: &mut ModuleOptions,
) -> Vec<(&'static str, String, String)> {
    let mut lowered = Vec::new();
    for o in OPTIONS {
        if let Some(c) = o.ceiling()
            && let Some((value, ceiling)) = (c.over)(ceilings, options)
        {
            (c.lower)(ceilings, options);
            lowered.push((o.name, value, ceiling));
        }
    }
    lowered
}

/// The module options as help text: each with its meaning, default and
/// bound (the default node ceiling where the node sets one).
pub fn options_help() -> String {
    let defaults = ModuleOptions::default();
    let ceilings = ModuleCeilings::default();
    let mut out = String::from(
        "Module options (--option NAME=VALUE; durations like 100ms or 5s, sizes like 64MiB):\n",
    );
    for o in OPTIONS {
        out.push_str(&format!(
            "  {}\n      {}\n      default {}; {}\n",
            o.name,
            o.meaning,
            o.value(&defaults),
            o.bound_text(&ceilings)
        ));
    }
    out
}

/// The node's ceilings as help text: each with its default and the option
/// it caps.
pub fn ceilings_help() -> String {
    let ceilings = ModuleCeilings::default();
    let mut out = String::from(
        "Module ceilings (--module-ceiling NAME=VALUE): a deploy asking for more is refused.\n",
    );
    for o in OPTIONS {
        if let Some(c) = o.ceiling() {
            out.push_str(&format!(
                "  {} (default {}): {}\n",
                o.name,
                (c.show)(&ceilings),
                o.meaning
            ));
        }
    }
    out
}

/// A value as the help writes it.
trait Show {
    fn show(&self) -> String;
}

impl Show for Duration {
    /// In its largest whole unit (`24h`, `5m`, `10s`, `100ms`), as
    /// `--option` takes it.
    fn show(&self) -> String {
        let (secs, nanos) = (self.as_secs(), self.subsec_nanos());
        if nanos != 0 {
            return if nanos % 1_000_000 == 0 {
                format!("{}ms", self.as_millis())
            } else {
                format!("{}ns", self.as_nanos())
            };
        }
        match secs {
            0 => "0s".to_owned(),
            s if s % 3600 == 0 => format!("{}h", s / 3600),
            s if s % 60 == 0 => format!("{}m", s / 60),
            s => format!("{s}s"),
        }
    }
}

impl Show for ByteSize {
    fn show(&self) -> String {
        self.to_string()
    }
}

impl Show for u32 {
    fn show(&self) -> String {
        self.to_string()
    }
}

impl Show for CpuShare {
    fn show(&self) -> String {
        self.to_string()
    }
}

impl Show for OnFence {
    fn show(&self) -> String {
        self.as_str().to_owned()
    }
}

impl Show for Option<ByteSize> {
    fn show(&self) -> String {
        self.map_or_else(
            || "the node's max_message_size".to_owned(),
            |s| s.to_string(),
        )
    }
}

impl Show for Option<DirGrant> {
    fn show(&self) -> String {
        match self {
            None => "none".to_owned(),
            Some(d) => format!(
                "{}:{}",
                d.host.display(),
                if d.writable { "rw" } else { "ro" }
            ),
        }
    }
}

fn duration(v: &str) -> std::result::Result<Duration, String> {
    humantime::parse_duration(v).map_err(|e| format!("{e} (write durations like 100ms or 5s)"))
}

fn size(v: &str) -> std::result::Result<ByteSize, String> {
    v.parse::<ByteSize>()
        .map_err(|e| format!("{e} (write sizes like 64MiB or 65536)"))
}

fn some_size(v: &str) -> std::result::Result<Option<ByteSize>, String> {
    size(v).map(Some)
}

fn count(v: &str) -> std::result::Result<u32, String> {
    v.parse::<u32>()
        .map_err(|e| format!("{e} (expected a whole number)"))
}

fn share(v: &str) -> std::result::Result<CpuShare, String> {
    v.parse::<CpuShare>().map_err(|e| e.to_string())
}

fn fence_mode(v: &str) -> std::result::Result<OnFence, String> {
    v.parse::<OnFence>()
}

fn dir(v: &str) -> std::result::Result<Option<DirGrant>, String> {
    v.parse::<DirGrant>().map(Some)
}

/// An option: `option!(name, parser, meaning, bound)`.
macro_rules! option {
    ($name:ident, $parse:ident, $meaning:expr, $bound:expr) => {
        OptionSpec {
            name: stringify!($name),
            meaning: $meaning,
            bound: $bound,
            set: |o, v| {
                o.$name = $parse(v)?;
                Ok(())
            },
            show: |o| o.$name.show(),
        }
    };
}

/// A node ceiling over the option of the same name.
macro_rules! ceiling {
    ($name:ident, $parse:ident) => {
        Bound::Ceiling(CeilingSpec {
            show: |c| c.$name.show(),
            set: |c, v| {
                c.$name = $parse(v)?;
                Ok(())
            },
            over: |c, o| (o.$name > c.$name).then(|| (o.$name.show(), c.$name.show())),
            lower: |c, o| o.$name = c.$name,
        })
    };
}

/// Every module option, in the order the help lists them and the ceilings
/// are checked.
pub static OPTIONS: &[OptionSpec] = &[
    option!(
        on_fence,
        fence_mode,
        "what the module's keys do when their node fences: terminate (killed at once), \
         continue (run on, every side effect refused), callback (handle-fence decides)",
        Bound::Fixed("one of terminate, continue, callback")
    ),
    option!(
        handle_fence_deadline,
        duration,
        "how long handle-fence may run under on_fence=callback",
        Bound::Fixed("within the node's fence budget (set by its lease timing and kill bound)")
    ),
    option!(
        memory_limit,
        size,
        "largest linear memory one key may grow to",
        Bound::Fixed("64KiB to the node's max_memory_per_key")
    ),
    option!(
        cpu_limit,
        duration,
        "CPU time one callback may use before the key is killed",
        ceiling!(cpu_limit, duration)
    ),
    option!(
        cpu_budget,
        share,
        "share of a core one key may use over cpu_budget_window (250m, 0.25, 25%); \
         over it callbacks wait",
        ceiling!(cpu_budget, share)
    ),
    option!(
        cpu_budget_window,
        duration,
        "the window cpu_budget is measured over (the burst a key may use)",
        Bound::Fixed("10ms to 1m")
    ),
    option!(
        max_live_keys,
        count,
        "most live keys of this module on one node",
        ceiling!(max_live_keys, count)
    ),
    option!(
        idle_timeout,
        duration,
        "a key with no message for this long is stopped",
        ceiling!(idle_timeout, duration)
    ),
    option!(
        mailbox_depth,
        count,
        "messages that may wait in one key's mailbox",
        ceiling!(mailbox_depth, count)
    ),
    option!(
        max_message_size,
        some_size,
        "largest message to one of the module's keys",
        Bound::Fixed("1 byte to the node's max_message_size")
    ),
    option!(
        max_reply_size,
        some_size,
        "largest reply from one of the module's keys",
        Bound::Fixed("1 byte to the node's max_message_size")
    ),
    option!(
        max_handoff_size,
        some_size,
        "largest state a key may hand on from handoff (a larger one is that key's loss, \
         reported)",
        Bound::Fixed("1 byte to the node's max_message_size")
    ),
    option!(
        max_timers_per_key,
        count,
        "timers one key may have armed at once",
        ceiling!(max_timers_per_key, count)
    ),
    option!(
        max_subscriptions_per_key,
        count,
        "topics one key may be subscribed to at once",
        ceiling!(max_subscriptions_per_key, count)
    ),
    option!(
        max_publishes_per_second,
        count,
        "publications one key may make per second",
        ceiling!(max_publishes_per_second, count)
    ),
    option!(
        max_host_bytes_per_key,
        size,
        "host memory one key may make the node hold (queued messages, timer tags, \
         subscriptions)",
        ceiling!(max_host_bytes_per_key, size)
    ),
    option!(
        max_log_lines_per_second,
        count,
        "log lines one key may make per second (over it lines are dropped and counted)",
        Bound::Fixed("1 to 10000")
    ),
    option!(
        max_log_bytes_per_second,
        size,
        "log bytes one key may make per second",
        Bound::Fixed("1KiB to 10MiB")
    ),
    option!(
        max_storage_value_size,
        size,
        "largest value one key may store under one name",
        ceiling!(max_storage_value_size, size)
    ),
    option!(
        max_storage_bytes_per_key,
        size,
        "most bytes (names and values) one key may store",
        ceiling!(max_storage_bytes_per_key, size)
    ),
    option!(
        max_storage_writes_per_callback,
        count,
        "most storage writes one callback may make",
        ceiling!(max_storage_writes_per_callback, count)
    ),
    option!(
        max_alarms_per_key,
        count,
        "most durable alarms one key may hold",
        ceiling!(max_alarms_per_key, count)
    ),
    option!(
        max_connections_per_key,
        count,
        "most WebSocket connections one key may have attached",
        ceiling!(max_connections_per_key, count)
    ),
    option!(
        max_frames_per_second,
        count,
        "most frames per second one WebSocket client may send",
        ceiling!(max_frames_per_second, count)
    ),
    option!(
        dir,
        dir,
        "a host directory preopened at /data in every key, /path:ro or /path:rw",
        Bound::Fixed("any directory for an admin's deploy; a tenant's only under its allowed_dirs")
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of the options and of the ceilings is in the table: a
    /// new option cannot be parsed, capped or listed without it.
    #[test]
    fn the_table_names_every_option_and_every_ceiling() {
        let fields = |v: serde_json::Value| -> Vec<String> {
            let mut names: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
            names.sort();
            names
        };
        let mut options: Vec<String> = OPTIONS.iter().map(|o| o.name.to_owned()).collect();
        options.sort();
        assert_eq!(
            fields(serde_json::to_value(ModuleOptions::default()).unwrap()),
            options
        );
        let mut capped: Vec<String> = OPTIONS
            .iter()
            .filter(|o| o.ceiling().is_some())
            .map(|o| o.name.to_owned())
            .collect();
        capped.sort();
        assert_eq!(
            fields(serde_json::to_value(ModuleCeilings::default()).unwrap()),
            capped
        );
    }

    /// Each option parses what the help says it takes, and each ceiling
    /// refuses an option over it, naming both.
    #[test]
    fn each_option_parses_and_each_ceiling_refuses_more() {
        let mut o = ModuleOptions::default();
        for (name, value) in [
            ("cpu_limit", "5s"),
            ("memory_limit", "32MiB"),
            ("max_live_keys", "7"),
            ("cpu_budget", "250m"),
            ("on_fence", "callback"),
            ("max_message_size", "1KiB"),
        ] {
            set_option(&mut o, name, value).unwrap();
            assert_eq!(
                find(name).unwrap().value(&o),
                find(name).unwrap().value(&{
                    let mut again = ModuleOptions::default();
                    set_option(&mut again, name, value).unwrap();
                    again
                })
            );
        }
        assert_eq!(o.cpu_limit, Duration::from_secs(5));
        assert_eq!(o.max_live_keys, 7);
        let mut c = ModuleCeilings::default();
        set_ceiling(&mut c, "max_live_keys", "6").unwrap();
        assert_eq!(
            first_over(&c, &o),
            Some(("max_live_keys", "7".to_owned(), "6".to_owned()))
        );
        let err = set_option(&mut o, "max_live_keys", "many").unwrap_err();
        assert!(err.to_string().contains("expected a whole number"), "{err}");
        let err = set_ceiling(&mut c, "memory_limit", "1GiB").unwrap_err();
        assert!(err.to_string().contains("known: cpu_limit"), "{err}");
    }

    /// The help lists every option with its default and bound.
    #[test]
    fn the_help_lists_every_option_with_its_default_and_bound() {
        let help = options_help();
        let defaults = ModuleOptions::default();
        for o in OPTIONS {
            let entry = format!(
                "  {}\n      {}\n      default {}; {}\n",
                o.name,
                o.meaning,
                o.value(&defaults),
                o.bound_text(&ModuleCeilings::default())
            );
            assert!(help.contains(&entry), "{} missing from:\n{help}", o.name);
        }
        assert!(help.contains("default 100ms; node ceiling 10s"), "{help}");
        assert!(ceilings_help().contains("max_connections_per_key (default 65536)"));
        assert!(ceilings_help().contains("idle_timeout (default 24h)"));
        assert_eq!(Duration::from_millis(1500).show(), "1500ms");
        assert_eq!(Duration::from_secs(90).show(), "90s");
    }
}
