//! The node's ceilings over a module version it *loads* from the store, as
//! opposed to one deployed through it (which [`ModuleCeilings::check`]
//! refuses outright).
//!
//! A version stored before the operator lowered a ceiling (on this node, or
//! by a node with higher ceilings) is still loaded at start and on every
//! follower round: refusing it would leave its keys unserved cluster-wide
//! for a setting only this node has. It runs here with every option over a
//! ceiling lowered to the ceiling, and each lowering is logged as a warning
//! naming the module, version, option, stored value and ceiling, and counted
//! (`fief_module_options_lowered_total`). The store keeps what was deployed;
//! a node with higher ceilings runs it as stored.
//!
//! Must not: raise an option, or change one that is within its ceiling.

use crate::config::{ByteSize, ModuleOptions, NodeConfig, option_table};

/// One option lowered to its ceiling.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Lowered {
    /// The option's name (`cpu_limit`).
    pub(crate) option: &'static str,
    /// What the stored version asked for, as text.
    pub(crate) value: String,
    /// The ceiling it runs under here, as text.
    pub(crate) ceiling: String,
}

/// `options` with every option over one of `node`'s ceilings lowered to it
/// (the module ceilings, `max_memory_per_key` for `memory_limit`, and
/// `max_message_size` for the message, reply and handoff sizes), and what was
/// lowered.
pub(crate) fn lower_to_ceilings(
    node: &NodeConfig,
    options: &ModuleOptions,
) -> (ModuleOptions, Vec<Lowered>) {
    let mut o = options.clone();
    let mut lowered: Vec<Lowered> = option_table::lower_to_ceilings(&node.module_ceilings, &mut o)
        .into_iter()
        .map(|(option, value, ceiling)| Lowered {
            option,
            value,
            ceiling,
        })
        .collect();
    fn cap(
        lowered: &mut Vec<Lowered>,
        option: &'static str,
        value: &mut ByteSize,
        ceiling: ByteSize,
    ) {
        if *value > ceiling {
            lowered.push(Lowered {
                option,
                value: value.to_string(),
                ceiling: ceiling.to_string(),
            });
            *value = ceiling;
        }
    }
    cap(
        &mut lowered,
        "memory_limit",
        &mut o.memory_limit,
        node.max_memory_per_key,
    );
    for (option, size) in [
        ("max_message_size", &mut o.max_message_size),
        ("max_reply_size", &mut o.max_reply_size),
        ("max_handoff_size", &mut o.max_handoff_size),
    ] {
        if let Some(size) = size.as_mut() {
            let ceiling: ByteSize = node.max_message_size;
            cap(&mut lowered, option, size, ceiling);
        }
    }
    (o, lowered)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn only_options_over_a_ceiling_are_lowered() {
        let mut node = NodeConfig::default();
        node.module_ceilings.cpu_limit = Duration::from_secs(1);
        node.module_ceilings.mailbox_depth = 100;
        node.module_ceilings.cpu_budget = "100m".parse().unwrap();
        node.module_ceilings.max_host_bytes_per_key = ByteSize::mib(1);
        let stored = ModuleOptions {
            cpu_budget: "500m".parse().unwrap(),
            max_host_bytes_per_key: ByteSize::mib(8),
            cpu_limit: Duration::from_secs(30),
            mailbox_depth: 50,
            max_timers_per_key: 10,
            memory_limit: ByteSize::gib(1),
            max_reply_size: Some(ByteSize::mib(8)),
            ..ModuleOptions::default()
        };
        let (options, lowered) = lower_to_ceilings(&node, &stored);
        assert_eq!(options.cpu_limit, Duration::from_secs(1));
        assert_eq!(options.mailbox_depth, 50, "under its ceiling: unchanged");
        assert_eq!(options.memory_limit, node.max_memory_per_key);
        assert_eq!(options.max_reply_size, Some(node.max_message_size));
        let names: Vec<_> = lowered.iter().map(|l| l.option).collect();
        assert_eq!(options.cpu_budget, node.module_ceilings.cpu_budget);
        assert_eq!(options.max_host_bytes_per_key, ByteSize::mib(1));
        assert_eq!(
            names,
            [
                "cpu_limit",
                "cpu_budget",
                "max_host_bytes_per_key",
                "memory_limit",
                "max_reply_size"
            ]
        );
        assert_eq!(lowered[0].value, "30s");
        assert_eq!(lowered[0].ceiling, "1s");
        assert!(
            options
                .validate_for(&node, &node.lease_timing().unwrap())
                .is_ok()
        );
    }

    #[test]
    fn options_within_every_ceiling_are_kept() {
        let node = NodeConfig::default();
        let (options, lowered) = lower_to_ceilings(&node, &ModuleOptions::default());
        assert_eq!(options, ModuleOptions::default());
        assert!(lowered.is_empty());
    }
}
