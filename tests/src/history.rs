//! The history checker: reads the event logs of a cluster's node processes
//! (`fief node --event-log`, see `fief::event_log`), merges them on one time
//! line (wall-clock microseconds; the processes share one machine) and fails
//! on any breach of single ownership (contract §1, guarantees 1–3):
//!
//! - **two live processes of one key** at one instant, on two nodes or on
//!   one (every module the tests deploy runs `on_fence = terminate`);
//! - **a message processed twice** (the tests make every message unique, so
//!   two `processing` lines with one digest for one key are one message
//!   handed to a guest twice, by two owners or by one);
//! - **a fenced node processing anything**: a message handed to a guest
//!   while its node held no current lease (before its first lease, after a
//!   fence point and before its next lease, after its process was gone);
//! - **an ownership token that goes back**: per key, in time order, tokens
//!   never decrease, and a message processed by another node process than
//!   the one before carries a strictly newer token;
//! - and records that contradict each other (a message processed outside
//!   any life of its key on that node, a key that ended without starting).
//!
//! A key process's *life* runs from its `key_started` line to the first of:
//! its `key_ended` line, the fence point of the lease it started under, and
//! the instant its process was known to be dead (SIGKILL). The fence point
//! ends it because past it the node acts for nothing: the side-effect gate
//! refuses every effect and the key loop every message (design §2.1), which
//! the "fenced node processing" check holds the node to. This is what lets a
//! node paused past its TTL (SIGSTOP) be judged fairly: its key processes
//! still exist until it resumes and kills them, but they can do nothing, and
//! the new owner must still not start before the old fence point. A life
//! that starts past the fence point of its lease (its activation raced the
//! fence) can do nothing at all and is empty.
//!
//! A failure prints every violation with a readable trace: the lines of the
//! key and of the node processes involved around the violation, merged with
//! the test's own notes (the faults it injected), times in seconds from the
//! first record.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::Path;

use fief::event_log::{EventRecord, RecordedEvent};

/// One node process's history: its event log and when it was known gone.
#[derive(Clone, Debug)]
pub struct NodeRun {
    /// A label for traces, e.g. `n2#1` (node n2, its second process).
    pub label: String,
    /// Its event log's records.
    pub records: Vec<EventRecord>,
    /// When the process was known to be dead (reaped after SIGKILL), in
    /// wall-clock µs; `None` if it may still run (its lives stay open).
    pub gone_at_us: Option<u64>,
}

impl NodeRun {
    /// Read the event log at `path` (JSON lines; a torn last line, which a
    /// kill mid-write could leave, is ignored).
    ///
    /// # Panics
    ///
    /// If the file cannot be read or a line before the last is not a
    /// record.
    pub fn read(label: &str, path: &Path, gone_at_us: Option<u64>) -> NodeRun {
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("reading the event log {}: {e}", path.display()));
        let lines: Vec<&str> = text.lines().collect();
        let mut records = Vec::with_capacity(lines.len());
        for (i, line) in lines.iter().enumerate() {
            match serde_json::from_str::<EventRecord>(line) {
                Ok(record) => records.push(record),
                Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => {}
                Err(e) => panic!(
                    "{}:{}: not an event record ({e}): {line}",
                    path.display(),
                    i + 1
                ),
            }
        }
        NodeRun {
            label: label.to_owned(),
            records,
            gone_at_us,
        }
    }
}

/// Something the test did, shown in traces among the nodes' records.
#[derive(Clone, Debug)]
pub struct Note {
    /// When, in wall-clock µs.
    pub t_us: u64,
    /// What (e.g. `SIGSTOP n3`).
    pub text: String,
}

/// What a clean history contained.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Node processes.
    pub runs: usize,
    /// Key process lives.
    pub lives: usize,
    /// Lives that started past the fence point of their lease (empty).
    pub empty_lives: usize,
    /// Lives whose node reached the fence point of their lease before the
    /// life ended or the process was gone (they end at the fence point).
    pub lives_cut_at_fence: usize,
    /// How close a key's next life on another node process came to the end
    /// of its life before, by how that life ended: how much room the
    /// handovers left.
    pub closest: Closest,
    /// Distinct `(module, key)`s.
    pub keys: usize,
    /// Messages handed to guests.
    pub processed: usize,
    /// Leases granted.
    pub leases: usize,
    /// Fences.
    pub fences: usize,
}

/// The smallest gap between the end of a key's life and the start of its
/// next life on another node process (µs, and the key), by how the earlier
/// life ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Closest {
    /// It ended (`key_ended`): a graceful handoff, an idle key, a kill.
    pub after_end: Option<(u64, String)>,
    /// Its node reached its fence point first (cut off, paused, arbiter
    /// gone): the gap is at least the fence margin, as the arbiter expires
    /// the lease no sooner than `fence_margin` after the fence point.
    pub after_fence_point: Option<(u64, String)>,
    /// Its process was killed.
    pub after_crash: Option<(u64, String)>,
}

impl Closest {
    fn note(&mut self, how: LifeEnd, gap: u64, key: &str) {
        let slot = match how {
            LifeEnd::Ended => &mut self.after_end,
            LifeEnd::FencePoint => &mut self.after_fence_point,
            LifeEnd::Gone => &mut self.after_crash,
        };
        if slot.as_ref().is_none_or(|(closest, _)| gap < *closest) {
            *slot = Some((gap, key.to_owned()));
        }
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} node processes, {} leases, {} fences, {} key lives ({} ended at a fence point, {} empty) of {} keys, {} messages processed",
            self.runs,
            self.leases,
            self.fences,
            self.lives,
            self.lives_cut_at_fence,
            self.empty_lives,
            self.keys,
            self.processed
        )?;
        let closest = [
            ("after a key ended", &self.closest.after_end),
            ("after a fence point", &self.closest.after_fence_point),
            ("after a crash", &self.closest.after_crash),
        ];
        for (what, gap) in closest {
            if let Some((gap, key)) = gap {
                write!(
                    f,
                    "; closest handover {what}: {:.1} ms ({key})",
                    *gap as f64 / 1000.0
                )?;
            }
        }
        Ok(())
    }
}

/// A breach found in a history. Runs are named by their labels, times are
/// wall-clock µs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Violation {
    /// Two lives of one key overlap: `second` started while `first` lived.
    Overlap {
        /// `module/key`.
        key: String,
        /// The life still running: (run, start, effective end).
        first: (String, u64, Option<u64>),
        /// The life that started: (run, start).
        second: (String, u64),
    },
    /// One message was handed to a guest twice.
    ProcessedTwice {
        /// `module/key`.
        key: String,
        /// The message's digest.
        digest: String,
        /// The first time: (run, when).
        first: (String, u64),
        /// The second time: (run, when).
        second: (String, u64),
    },
    /// A message was handed to a guest while its node held no current lease.
    ProcessedWhileFenced {
        /// `module/key`.
        key: String,
        /// The run.
        run: String,
        /// When.
        at: u64,
    },
    /// A message was handed to a guest outside any life of its key on that
    /// node process (the records contradict each other).
    ProcessedOutsideLife {
        /// `module/key`.
        key: String,
        /// The run.
        run: String,
        /// When.
        at: u64,
    },
    /// A key's ownership token went back, or stayed equal across a change
    /// of node process.
    TokenWentBack {
        /// `module/key`.
        key: String,
        /// The earlier message: (run, when, token).
        earlier: (String, u64, u64),
        /// The later message: (run, when, token).
        later: (String, u64, u64),
    },
    /// A key ended on a node process where it had not started.
    EndWithoutStart {
        /// `module/key`.
        key: String,
        /// The run.
        run: String,
        /// When.
        at: u64,
    },
}

impl Violation {
    /// The `module/key` the violation is about.
    fn key(&self) -> &str {
        match self {
            Violation::Overlap { key, .. }
            | Violation::ProcessedTwice { key, .. }
            | Violation::ProcessedWhileFenced { key, .. }
            | Violation::ProcessedOutsideLife { key, .. }
            | Violation::TokenWentBack { key, .. }
            | Violation::EndWithoutStart { key, .. } => key,
        }
    }

    /// When it happened (the later event), and the runs involved.
    fn when_and_runs(&self) -> (u64, Vec<&str>) {
        match self {
            Violation::Overlap { first, second, .. } => (second.1, vec![&first.0, &second.0]),
            Violation::ProcessedTwice { first, second, .. } => {
                (second.1, vec![&first.0, &second.0])
            }
            Violation::TokenWentBack { earlier, later, .. } => {
                (later.1, vec![&earlier.0, &later.0])
            }
            Violation::ProcessedWhileFenced { run, at, .. }
            | Violation::ProcessedOutsideLife { run, at, .. }
            | Violation::EndWithoutStart { run, at, .. } => (*at, vec![run]),
        }
    }
}

/// A failed check: the violations, shown with their traces.
#[derive(Clone, Debug)]
pub struct Failure {
    /// Every violation found.
    pub violations: Vec<Violation>,
    /// The rendered report (violations and traces).
    pub report: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.report)
    }
}

/// One life of a key on one run, with its effective end.
#[derive(Clone, Debug)]
struct Life {
    run: usize,
    start: u64,
    /// The `key_ended` line, if any.
    ended: Option<u64>,
    /// The fence point of the lease it started under, if that lease has
    /// one (the start itself if it started past it).
    fence_point: Option<u64>,
    /// When its process was known gone.
    gone: Option<u64>,
}

/// What ended a life first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LifeEnd {
    Ended,
    FencePoint,
    Gone,
}

impl Life {
    /// The end used for overlap, and what it is: the first of its end, its
    /// lease's fence point and its process gone; `None` = still open.
    fn end(&self) -> Option<(u64, LifeEnd)> {
        [
            (self.ended, LifeEnd::Ended),
            (self.fence_point, LifeEnd::FencePoint),
            (self.gone, LifeEnd::Gone),
        ]
        .into_iter()
        .filter_map(|(t, how)| t.map(|t| (t, how)))
        .min_by_key(|(t, _)| *t)
    }
}

/// A run's lease windows: `[granted, fence point)`, `None` = open.
type Windows = Vec<(u64, Option<u64>)>;

fn lease_windows(records: &[&EventRecord]) -> Windows {
    let mut windows: Windows = Vec::new();
    for record in records {
        match &record.event {
            RecordedEvent::LeaseGranted { .. } => windows.push((record.t_us, None)),
            RecordedEvent::Fenced { fence_point_us, .. } => {
                if let Some(window) = windows.last_mut()
                    && window.1.is_none()
                {
                    window.1 = Some(*fence_point_us);
                }
            }
            _ => {}
        }
    }
    windows
}

/// The end of the window that contains `t`, if one does (`Some(None)`: an
/// open window).
fn window_at(windows: &Windows, t: u64) -> Option<Option<u64>> {
    windows
        .iter()
        .find(|(start, end)| *start <= t && end.is_none_or(|end| t < end))
        .map(|(_, end)| *end)
}

/// Check a cluster's history; `notes` only annotate the traces.
///
/// # Errors
///
/// Every violation found, with a readable report.
pub fn check(runs: &[NodeRun], notes: &[Note]) -> Result<Summary, Failure> {
    let mut summary = Summary {
        runs: runs.len(),
        ..Summary::default()
    };
    let mut violations = Vec::new();
    let mut lives: BTreeMap<String, Vec<Life>> = BTreeMap::new();
    // (key, digest) → first (run, when); key → [(when, run, token)].
    let mut seen: HashMap<(String, String), (usize, u64)> = HashMap::new();
    let mut tokens: BTreeMap<String, Vec<(u64, usize, u64)>> = BTreeMap::new();
    for (r, run) in runs.iter().enumerate() {
        let mut records: Vec<&EventRecord> = run.records.iter().collect();
        records.sort_by_key(|record| record.t_us);
        let windows = lease_windows(&records);
        // Lives of this run, by key, in start order.
        let mut open: HashMap<String, usize> = HashMap::new();
        let mut run_lives: BTreeMap<String, Vec<Life>> = BTreeMap::new();
        for record in &records {
            let t = record.t_us;
            match &record.event {
                RecordedEvent::LeaseGranted { .. } => summary.leases += 1,
                RecordedEvent::Fenced { .. } => summary.fences += 1,
                RecordedEvent::KeyStarted { module, key } => {
                    let name = format!("{module}/{key}");
                    // Outside every lease (started past its lease's fence
                    // point): empty.
                    let fence_point = window_at(&windows, t).unwrap_or(Some(t));
                    let list = run_lives.entry(name.clone()).or_default();
                    list.push(Life {
                        run: r,
                        start: t,
                        ended: None,
                        fence_point,
                        gone: run.gone_at_us,
                    });
                    open.insert(name, list.len() - 1);
                }
                RecordedEvent::KeyEnded { module, key } => {
                    let name = format!("{module}/{key}");
                    match open.remove(&name) {
                        Some(i) => {
                            run_lives.get_mut(&name).expect("opened")[i].ended = Some(t);
                        }
                        None => violations.push(Violation::EndWithoutStart {
                            key: name,
                            run: run.label.clone(),
                            at: t,
                        }),
                    }
                }
                RecordedEvent::Processing {
                    module,
                    key,
                    token,
                    digest,
                    ..
                } => {
                    summary.processed += 1;
                    let name = format!("{module}/{key}");
                    if window_at(&windows, t).is_none() {
                        violations.push(Violation::ProcessedWhileFenced {
                            key: name.clone(),
                            run: run.label.clone(),
                            at: t,
                        });
                    }
                    let in_life = run_lives.get(&name).is_some_and(|list| {
                        list.iter()
                            .any(|l| l.start <= t && l.ended.is_none_or(|e| t <= e))
                    });
                    if !in_life {
                        violations.push(Violation::ProcessedOutsideLife {
                            key: name.clone(),
                            run: run.label.clone(),
                            at: t,
                        });
                    }
                    match seen.get(&(name.clone(), digest.clone())) {
                        Some(&(first_run, first_at)) => {
                            violations.push(Violation::ProcessedTwice {
                                key: name.clone(),
                                digest: digest.clone(),
                                first: (runs[first_run].label.clone(), first_at),
                                second: (run.label.clone(), t),
                            });
                        }
                        None => {
                            seen.insert((name.clone(), digest.clone()), (r, t));
                        }
                    }
                    tokens.entry(name).or_default().push((t, r, *token));
                }
                RecordedEvent::Opened { .. } => {}
            }
        }
        for (name, list) in run_lives {
            lives.entry(name).or_default().extend(list);
        }
    }
    summary.keys = lives.len();
    for (name, list) in &mut lives {
        summary.lives += list.len();
        let empty = |l: &Life| l.end().is_some_and(|(end, _)| end <= l.start);
        summary.empty_lives += list.iter().filter(|l| empty(l)).count();
        list.retain(|l| !empty(l));
        summary.lives_cut_at_fence += list
            .iter()
            .filter(|l| matches!(l.end(), Some((_, LifeEnd::FencePoint))))
            .count();
        list.sort_by_key(|l| l.start);
        // The life reaching furthest so far; a start before its end overlaps.
        let mut reach: Option<&Life> = None;
        for life in list.iter() {
            if let Some(before) = reach {
                match before.end() {
                    Some((end, how)) if end <= life.start => {
                        if before.run != life.run {
                            summary.closest.note(how, life.start - end, name);
                        }
                    }
                    end => violations.push(Violation::Overlap {
                        key: name.clone(),
                        first: (
                            runs[before.run].label.clone(),
                            before.start,
                            end.map(|(end, _)| end),
                        ),
                        second: (runs[life.run].label.clone(), life.start),
                    }),
                }
            }
            let further = reach.is_none_or(|before| match (before.end(), life.end()) {
                (None, _) => false,
                (Some(_), None) => true,
                (Some((a, _)), Some((b, _))) => b > a,
            });
            if further {
                reach = Some(life);
            }
        }
    }
    for (name, list) in &mut tokens {
        list.sort_by_key(|(t, _, _)| *t);
        for pair in list.windows(2) {
            let ((t1, r1, k1), (t2, r2, k2)) = (pair[0], pair[1]);
            if k2 < k1 || (r1 != r2 && k2 == k1) {
                violations.push(Violation::TokenWentBack {
                    key: name.clone(),
                    earlier: (runs[r1].label.clone(), t1, k1),
                    later: (runs[r2].label.clone(), t2, k2),
                });
            }
        }
    }
    if violations.is_empty() {
        Ok(summary)
    } else {
        let report = report(runs, notes, &violations);
        Err(Failure { violations, report })
    }
}

/// Panic with the report unless the history is clean; the summary if it is.
pub fn assert_single_ownership(runs: &[NodeRun], notes: &[Note]) -> Summary {
    match check(runs, notes) {
        Ok(summary) => summary,
        Err(failure) => panic!("{failure}"),
    }
}

/// How much of the time line a trace shows before and after a violation.
const TRACE_BEFORE_US: u64 = 4_000_000;
const TRACE_AFTER_US: u64 = 1_000_000;
/// Most lines per trace (the last ones before the violation are kept).
const TRACE_LINES: usize = 80;

fn report(runs: &[NodeRun], notes: &[Note], violations: &[Violation]) -> String {
    let t0 = runs
        .iter()
        .flat_map(|run| run.records.first())
        .map(|r| r.t_us)
        .chain(notes.iter().map(|n| n.t_us))
        .min()
        .unwrap_or(0);
    let secs = |t: u64| format!("{:+.3}s", (t as f64 - t0 as f64) / 1e6);
    let mut out = format!(
        "single ownership violated: {} violation(s); times are seconds from the first record\n",
        violations.len()
    );
    for (i, violation) in violations.iter().enumerate() {
        out.push_str(&format!("\n{}. {}\n", i + 1, describe(violation, &secs)));
        let (at, involved) = violation.when_and_runs();
        let from = at.saturating_sub(TRACE_BEFORE_US);
        let to = at + TRACE_AFTER_US;
        let key = violation.key();
        let mut lines: Vec<(u64, String)> = Vec::new();
        for run in runs {
            let involved = involved.contains(&run.label.as_str());
            for record in &run.records {
                if record.t_us < from || record.t_us > to {
                    continue;
                }
                let about_key = match &record.event {
                    RecordedEvent::KeyStarted { module, key: k }
                    | RecordedEvent::KeyEnded { module, key: k }
                    | RecordedEvent::Processing { module, key: k, .. } => {
                        format!("{module}/{k}") == key
                    }
                    RecordedEvent::LeaseGranted { .. }
                    | RecordedEvent::Fenced { .. }
                    | RecordedEvent::Opened { .. } => involved,
                };
                if about_key {
                    lines.push((
                        record.t_us,
                        format!("{:<6} {}", run.label, show(&record.event, &secs)),
                    ));
                }
            }
            if let Some(gone) = run.gone_at_us
                && (from..=to).contains(&gone)
            {
                lines.push((gone, format!("{:<6} process gone (killed)", run.label)));
            }
        }
        for note in notes {
            if (from..=to).contains(&note.t_us) {
                lines.push((note.t_us, format!("test   {}", note.text)));
            }
        }
        lines.sort_by_key(|(t, _)| *t);
        let skipped = lines.len().saturating_sub(TRACE_LINES);
        out.push_str(&format!(
            "   trace of {key} and of {} ({} to {}):\n",
            involved.join(", "),
            secs(from),
            secs(to)
        ));
        if skipped > 0 {
            out.push_str(&format!("     ... {skipped} earlier lines\n"));
        }
        for (t, line) in &lines[skipped..] {
            out.push_str(&format!("     {:>10}  {line}\n", secs(*t)));
        }
    }
    out
}

fn describe(violation: &Violation, secs: &dyn Fn(u64) -> String) -> String {
    match violation {
        Violation::Overlap { key, first, second } => format!(
            "two live processes of {key}: one started on {} at {} while the one on {} (started {}) lived until {}",
            second.0,
            secs(second.1),
            first.0,
            secs(first.1),
            first.2.map_or("the end of the record".to_owned(), secs)
        ),
        Violation::ProcessedTwice {
            key,
            digest,
            first,
            second,
        } => format!(
            "message {digest} of {key} processed twice: on {} at {} and on {} at {}",
            first.0,
            secs(first.1),
            second.0,
            secs(second.1)
        ),
        Violation::ProcessedWhileFenced { key, run, at } => format!(
            "{run} processed a message of {key} at {} without a current lease (fenced)",
            secs(*at)
        ),
        Violation::ProcessedOutsideLife { key, run, at } => format!(
            "{run} processed a message of {key} at {} outside any life of the key there",
            secs(*at)
        ),
        Violation::TokenWentBack {
            key,
            earlier,
            later,
        } => format!(
            "the ownership token of {key} went from {} ({} at {}) to {} ({} at {})",
            earlier.2,
            earlier.0,
            secs(earlier.1),
            later.2,
            later.0,
            secs(later.1)
        ),
        Violation::EndWithoutStart { key, run, at } => {
            format!(
                "{key} ended on {run} at {} without having started",
                secs(*at)
            )
        }
    }
}

fn show(event: &RecordedEvent, secs: &dyn Fn(u64) -> String) -> String {
    match event {
        RecordedEvent::Opened { pid } => format!("event log opened (pid {pid})"),
        RecordedEvent::KeyStarted { module, key } => format!("key started {module}/{key}"),
        RecordedEvent::KeyEnded { module, key } => format!("key ended   {module}/{key}"),
        RecordedEvent::Processing {
            module,
            key,
            token,
            kind,
            digest,
        } => format!("processing  {module}/{key} {kind:?} {digest} (token {token})"),
        RecordedEvent::LeaseGranted { lease } => format!("lease {lease} granted"),
        RecordedEvent::Fenced {
            fence_point_us,
            cause,
        } => format!("fenced (fence point {}): {cause}", secs(*fence_point_us)),
    }
}
