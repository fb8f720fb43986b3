//! The PostgreSQL backend: durable key state in four tables of a
//! namespace (fence tokens, entries, alarms, tenant usage), created by an idempotent
//! migration at connect under an advisory lock. It owns its connection
//! (reconnecting on the round after one broke), its SQL and the order in
//! which a round's transaction locks rows. It must not decide anything but
//! what `super::plan` decides.
//!
//! A round is one transaction: insert missing fence rows, lock every fence
//! row the round touches in ascending partition order (so two nodes never
//! deadlock), decide, raise tokens, apply the landed commits' writes set-wise
//! (one statement per kind of write, arrays through `unnest`), lock and
//! update the tenants' usage rows (ascending, after every fence row), then
//! read the loads' entries and alarms and the partitions' alarms. The alarm
//! table's primary key leads with the partition, so a partition's alarms
//! are one index range.
//!
//! Portability (to PostgreSQL-compatible distributed databases such as
//! CockroachDB or YugabyteDB): only `CREATE TABLE IF NOT EXISTS`, composite
//! primary keys, `INSERT … ON CONFLICT`, `SELECT … FOR UPDATE`, `unnest` of
//! arrays, `UPDATE … FROM` and `DELETE … USING`. Entry names are `bytea`,
//! which every one of them compares byte-wise, where `text` order follows
//! the database's collation and `COLLATE "C"` is not accepted everywhere.
//! The advisory lock around the migration is PostgreSQL's (CockroachDB
//! accepts the call as a no-op; the migration is idempotent anyway), and a
//! serializable database may abort a round with `40001`, which is retried.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls, Statement, Transaction};

use super::plan::{self, Decisions};
use super::{
    AlarmId, Backend, BackendError, BoxFuture, KeyScope, Loaded, Round, RoundResult, StoredAlarm,
    Write,
};

/// A key's entries, sorted by name.
type Entries = Vec<(String, Vec<u8>)>;

/// The migration: idempotent, run by every node at connect.
const MIGRATION: &str = r#"
CREATE TABLE IF NOT EXISTS fief_storage_fences (
    namespace text NOT NULL,
    partition integer NOT NULL,
    token     bigint NOT NULL,
    PRIMARY KEY (namespace, partition)
);
CREATE TABLE IF NOT EXISTS fief_storage_entries (
    namespace text NOT NULL,
    module    text NOT NULL,
    key       text NOT NULL,
    name      bytea NOT NULL,
    value     bytea NOT NULL,
    PRIMARY KEY (namespace, module, key, name)
);
CREATE TABLE IF NOT EXISTS fief_storage_alarms (
    namespace text NOT NULL,
    partition integer NOT NULL,
    module    text NOT NULL,
    key       text NOT NULL,
    name      bytea NOT NULL,
    at_ms     bigint NOT NULL,
    PRIMARY KEY (namespace, partition, module, key, name)
);
CREATE TABLE IF NOT EXISTS fief_storage_usage (
    namespace text NOT NULL,
    tenant    text NOT NULL,
    bytes     bigint NOT NULL,
    PRIMARY KEY (namespace, tenant)
);
"#;

/// Key of the advisory lock that serializes this migration ("fiefst").
const MIGRATION_LOCK: i64 = 0x66_69_65_66_73_74;

/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// How long the server lets a session sit idle inside a transaction before
/// it ends it (`idle_in_transaction_session_timeout`). A round holds the
/// fence rows of its partitions locked (`FOR UPDATE`) until it commits; a
/// node paused (SIGSTOP) or cut off mid-round would hold them until its dead
/// TCP connection is noticed (minutes), and the new owner's first load would
/// wait that long. A round's statements are sent back to back, with only the
/// node's own CPU work between them (a few milliseconds even for a large
/// round), so three seconds of silence means the node is gone: the server
/// rolls the round back (nothing of it lands) and frees the rows. Longer
/// than the arbiter's one second, because a round can be far larger than
/// the arbiter's transactions and a busy node's blocking pool may lag.
const IDLE_IN_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(3);

/// How often a round aborted by a serialization failure (`40001`, which a
/// serializable database may raise) is tried before it is reported.
const SERIALIZATION_ATTEMPTS: usize = 3;

/// Durable key state in PostgreSQL (see the module docs).
pub struct PostgresBackend {
    url: String,
    namespace: String,
    /// `host:port/db`, for `describe` (no user, no password).
    location: String,
    conn: Mutex<Option<Conn>>,
}

/// A connection and its prepared statements.
struct Conn {
    client: Client,
    st: Statements,
}

/// The statements of a round and of `read`, prepared once per connection.
struct Statements {
    insert_fences: Statement,
    lock_fences: Statement,
    raise_fences: Statement,
    delete_ranges: Statement,
    delete_names: Statement,
    upsert: Statement,
    delete_alarms: Statement,
    upsert_alarms: Statement,
    insert_usage: Statement,
    lock_usage: Statement,
    set_usage: Statement,
    read_usage: Statement,
    read_entries: Statement,
    read_key_alarms: Statement,
    read_partition_alarms: Statement,
    read_prefix: Statement,
}

impl Statements {
    async fn prepare(client: &Client) -> Result<Self, tokio_postgres::Error> {
        Ok(Statements {
            insert_fences: client
                .prepare(
                    "INSERT INTO fief_storage_fences (namespace, partition, token)
                     SELECT $1::text, p, 0 FROM unnest($2::int4[]) AS u(p) ORDER BY p
                     ON CONFLICT DO NOTHING",
                )
                .await?,
            lock_fences: client
                .prepare(
                    "SELECT partition, token FROM fief_storage_fences
                     WHERE namespace = $1 AND partition = ANY($2::int4[])
                     ORDER BY partition FOR UPDATE",
                )
                .await?,
            raise_fences: client
                .prepare(
                    "UPDATE fief_storage_fences AS f SET token = u.token
                     FROM unnest($2::int4[], $3::int8[]) AS u(partition, token)
                     WHERE f.namespace = $1 AND f.partition = u.partition",
                )
                .await?,
            delete_ranges: client
                .prepare(
                    "DELETE FROM fief_storage_entries AS e
                     USING unnest($2::text[], $3::text[], $4::bytea[], $5::bytea[])
                         AS r(module, key, lo, hi)
                     WHERE e.namespace = $1 AND e.module = r.module AND e.key = r.key
                       AND e.name >= r.lo AND (r.hi IS NULL OR e.name < r.hi)",
                )
                .await?,
            delete_names: client
                .prepare(
                    "DELETE FROM fief_storage_entries AS e
                     USING unnest($2::text[], $3::text[], $4::bytea[]) AS d(module, key, name)
                     WHERE e.namespace = $1 AND e.module = d.module AND e.key = d.key
                       AND e.name = d.name",
                )
                .await?,
            upsert: client
                .prepare(
                    "INSERT INTO fief_storage_entries (namespace, module, key, name, value)
                     SELECT $1::text, u.module, u.key, u.name, u.value
                     FROM unnest($2::text[], $3::text[], $4::bytea[], $5::bytea[])
                         AS u(module, key, name, value)
                     ON CONFLICT (namespace, module, key, name)
                     DO UPDATE SET value = excluded.value",
                )
                .await?,
            delete_alarms: client
                .prepare(
                    "DELETE FROM fief_storage_alarms AS a
                     USING unnest($2::int4[], $3::text[], $4::text[], $5::bytea[])
                         AS d(partition, module, key, name)
                     WHERE a.namespace = $1 AND a.partition = d.partition
                       AND a.module = d.module AND a.key = d.key AND a.name = d.name",
                )
                .await?,
            upsert_alarms: client
                .prepare(
                    "INSERT INTO fief_storage_alarms (namespace, partition, module, key, name, at_ms)
                     SELECT $1::text, u.partition, u.module, u.key, u.name, u.at_ms
                     FROM unnest($2::int4[], $3::text[], $4::text[], $5::bytea[], $6::int8[])
                         AS u(partition, module, key, name, at_ms)
                     ON CONFLICT (namespace, partition, module, key, name)
                     DO UPDATE SET at_ms = excluded.at_ms",
                )
                .await?,
            insert_usage: client
                .prepare(
                    "INSERT INTO fief_storage_usage (namespace, tenant, bytes)
                     SELECT $1::text, t, 0 FROM unnest($2::text[]) AS u(t) ORDER BY t
                     ON CONFLICT DO NOTHING",
                )
                .await?,
            lock_usage: client
                .prepare(
                    "SELECT tenant, bytes FROM fief_storage_usage
                     WHERE namespace = $1 AND tenant = ANY($2::text[])
                     ORDER BY tenant FOR UPDATE",
                )
                .await?,
            set_usage: client
                .prepare(
                    "UPDATE fief_storage_usage AS s SET bytes = u.bytes
                     FROM unnest($2::text[], $3::int8[]) AS u(tenant, bytes)
                     WHERE s.namespace = $1 AND s.tenant = u.tenant",
                )
                .await?,
            read_usage: client
                .prepare(
                    "SELECT tenant, bytes FROM fief_storage_usage
                     WHERE namespace = $1 AND tenant = ANY($2::text[])",
                )
                .await?,
            read_entries: client
                .prepare(
                    "SELECT e.module, e.key, e.name, e.value
                     FROM fief_storage_entries AS e
                     JOIN unnest($2::text[], $3::text[]) AS l(module, key)
                       ON e.module = l.module AND e.key = l.key
                     WHERE e.namespace = $1
                     ORDER BY e.name",
                )
                .await?,
            read_key_alarms: client
                .prepare(
                    "SELECT a.partition, a.module, a.key, a.name, a.at_ms
                     FROM fief_storage_alarms AS a
                     JOIN unnest($2::int4[], $3::text[], $4::text[]) AS l(partition, module, key)
                       ON a.partition = l.partition AND a.module = l.module AND a.key = l.key
                     WHERE a.namespace = $1
                     ORDER BY a.name",
                )
                .await?,
            read_partition_alarms: client
                .prepare(
                    "SELECT partition, module, key, name, at_ms FROM fief_storage_alarms
                     WHERE namespace = $1 AND partition = ANY($2::int4[])",
                )
                .await?,
            read_prefix: client
                .prepare(
                    "SELECT name, value FROM fief_storage_entries
                     WHERE namespace = $1 AND module = $2 AND key = $3
                       AND name >= $4 AND ($5::bytea IS NULL OR name < $5)
                     ORDER BY name LIMIT $6",
                )
                .await?,
        })
    }
}

/// A failure of the store, with the server's own message when there is one
/// (tokio-postgres's `Display` leaves it out).
fn unavailable(e: &tokio_postgres::Error) -> BackendError {
    BackendError::Unavailable(match e.as_db_error() {
        Some(db) => format!("PostgreSQL: {}: {}", db.code().code(), db.message()),
        None => format!("PostgreSQL: {e}"),
    })
}

fn is_serialization_failure(e: &tokio_postgres::Error) -> bool {
    e.as_db_error().map(|d| d.code().code()) == Some("40001")
}

/// A stored name: its UTF-8 bytes; one read back that is not UTF-8 (written
/// by something else) is replaced lossily rather than failing the round.
fn name_of(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

impl PostgresBackend {
    /// Connect to `url` (`postgres://user@host:port/db`), run the
    /// migration, and keep the state of `namespace` (a node's cluster
    /// namespace: the same database can hold several).
    ///
    /// # Errors
    ///
    /// [`BackendError::Unavailable`] when the URL is not a PostgreSQL URL,
    /// the server cannot be reached, or the migration fails.
    pub async fn connect(url: &str, namespace: &str) -> Result<Self, BackendError> {
        let config: tokio_postgres::Config = url.parse().map_err(|e| {
            BackendError::Unavailable(format!("{url:?} is not a PostgreSQL URL: {e}"))
        })?;
        let host = match config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            #[cfg(unix)]
            Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
            None => "localhost".to_owned(),
        };
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let db = config.get_dbname().unwrap_or("");
        let backend = PostgresBackend {
            url: url.to_owned(),
            namespace: namespace.to_owned(),
            location: format!("{host}:{port}/{db}"),
            conn: Mutex::new(None),
        };
        let mut client = backend.client().await?;
        let migrate = async {
            let tx = client.transaction().await?;
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
                .await?;
            tx.batch_execute("SET LOCAL client_min_messages = warning")
                .await?;
            tx.batch_execute(MIGRATION).await?;
            tx.commit().await
        };
        migrate.await.map_err(|e| unavailable(&e))?;
        let st = Statements::prepare(&client)
            .await
            .map_err(|e| unavailable(&e))?;
        *backend.conn.lock().await = Some(Conn { client, st });
        Ok(backend)
    }

    /// A new connection with the session settings and statements.
    async fn open(&self) -> Result<Conn, BackendError> {
        let client = self.client().await?;
        let st = Statements::prepare(&client)
            .await
            .map_err(|e| unavailable(&e))?;
        Ok(Conn { client, st })
    }

    /// A new connection with the session settings.
    async fn client(&self) -> Result<Client, BackendError> {
        let mut config: tokio_postgres::Config = self.url.parse().map_err(|e| {
            BackendError::Unavailable(format!("{:?} is not a PostgreSQL URL: {e}", self.url))
        })?;
        config.connect_timeout(CONNECT_TIMEOUT);
        let ours = format!(
            "-c idle_in_transaction_session_timeout={}",
            IDLE_IN_TRANSACTION_TIMEOUT.as_millis()
        );
        let options = match config.get_options() {
            Some(theirs) if !theirs.is_empty() => format!("{theirs} {ours}"),
            _ => ours,
        };
        config.options(options);
        let (client, connection) = tokio::time::timeout(CONNECT_TIMEOUT, config.connect(NoTls))
            .await
            .map_err(|_| BackendError::Unavailable("PostgreSQL: connecting timed out".into()))?
            .map_err(|e| unavailable(&e))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::warn!(error = %e, "the storage's PostgreSQL connection closed");
            }
        });
        Ok(client)
    }

    /// Run `op` on the connection, connecting first if there is none or
    /// the last one broke; a failure that is not the server's answer drops
    /// the connection so the next call reconnects. A serialization failure
    /// is retried.
    async fn with(&self, op: Op<'_>) -> Result<Answer, BackendError> {
        let mut guard = self.conn.lock().await;
        let mut attempt = 1;
        loop {
            if guard.as_ref().is_none_or(|c| c.client.is_closed()) {
                *guard = Some(self.open().await?);
            }
            let conn = guard.as_mut().expect("connected");
            match op.run(conn, &self.namespace).await {
                Ok(v) => return Ok(v),
                Err(e) if is_serialization_failure(&e) && attempt < SERIALIZATION_ATTEMPTS => {
                    attempt += 1;
                }
                Err(e) => {
                    if conn.client.is_closed() || e.as_db_error().is_none() {
                        *guard = None;
                    }
                    return Err(unavailable(&e));
                }
            }
        }
    }
}

/// What [`PostgresBackend::with`] runs.
enum Op<'a> {
    /// A round, in one transaction.
    Round(&'a Round),
    /// An operator's read: scope, prefix, limit.
    Read(&'a KeyScope, &'a str, u32),
    /// An operator's read of a key's alarms: scope, partition.
    ReadAlarms(&'a KeyScope, u32),
    /// The namespace's highest fence token.
    HighestFence,
}

/// What an [`Op`] answers.
enum Answer {
    Round(RoundResult),
    Read(Entries),
    Alarms(Vec<(String, u64)>),
    Token(u64),
}

impl Op<'_> {
    async fn run(&self, conn: &mut Conn, ns: &str) -> Result<Answer, tokio_postgres::Error> {
        match self {
            Op::Round(round) => {
                let tx = conn.client.transaction().await?;
                let result = run_round(&tx, &conn.st, ns, round).await?;
                tx.commit().await?;
                Ok(Answer::Round(result))
            }
            Op::HighestFence => {
                let row = conn
                    .client
                    .query_one(
                        "SELECT COALESCE(MAX(token), 0) FROM fief_storage_fences
                         WHERE namespace = $1",
                        &[&ns],
                    )
                    .await?;
                // The same 64 bits as stored (see `stored`); tokens are table
                // epochs, far below 2^63, so the signed MAX orders them.
                Ok(Answer::Token(row.get::<_, i64>(0) as u64))
            }
            Op::Read(scope, prefix, limit) => {
                let end = plan::prefix_end(prefix);
                let rows = conn
                    .client
                    .query(
                        &conn.st.read_prefix,
                        &[
                            &ns,
                            &scope.module,
                            &scope.key,
                            &prefix.as_bytes(),
                            &end.as_deref(),
                            &i64::from(*limit),
                        ],
                    )
                    .await?;
                Ok(Answer::Read(
                    rows.into_iter()
                        .map(|r| (name_of(r.get(0)), r.get(1)))
                        .collect(),
                ))
            }
            Op::ReadAlarms(scope, partition) => {
                let rows = conn
                    .client
                    .query(
                        "SELECT name, at_ms FROM fief_storage_alarms
                         WHERE namespace = $1 AND partition = $2 AND module = $3 AND key = $4
                         ORDER BY name",
                        &[
                            &ns,
                            &i32::try_from(*partition).unwrap_or(i32::MAX),
                            &scope.module,
                            &scope.key,
                        ],
                    )
                    .await?;
                Ok(Answer::Alarms(
                    rows.into_iter()
                        .map(|r| {
                            let at: i64 = r.get(1);
                            (name_of(r.get(0)), u64::try_from(at).unwrap_or(0))
                        })
                        .collect(),
                ))
            }
        }
    }
}

/// The landed commits' writes of a round, resolved per name to what each
/// statement must do, since one statement cannot touch a row twice: delete
/// the stored rows in the ranges first, then delete the names whose last
/// write is a delete, then upsert the names whose last write is a put. A
/// range drops the round's earlier writes to names inside it (the range
/// deletes their stored rows; a put after it wins again).
/// A key's names and their last value in a round (`None`: deleted).
type LastWrites<'r> = BTreeMap<&'r str, Option<&'r [u8]>>;

/// An alarm row's key: (partition, module, key, name).
type AlarmRow<'r> = (u32, &'r str, &'r str, &'r str);

#[derive(Default)]
struct Batch<'r> {
    /// Per key: name → its last value (`None`: deleted).
    names: BTreeMap<(&'r str, &'r str), LastWrites<'r>>,
    /// (module, key, start, end) of every range.
    ranges: Vec<(&'r str, &'r str, &'r str, Option<&'r str>)>,
    /// Per alarm: its last time (`None`: cancelled).
    alarms: BTreeMap<AlarmRow<'r>, Option<u64>>,
}

impl<'r> Batch<'r> {
    fn of(round: &'r Round, decisions: &Decisions) -> Self {
        let mut batch = Batch::default();
        for commit in decisions.landed(round) {
            let (module, key) = (commit.scope.module.as_str(), commit.scope.key.as_str());
            let names = batch.names.entry((module, key)).or_default();
            for write in &commit.writes {
                match write {
                    Write::Put { name, value } => {
                        names.insert(name.as_str(), Some(value.as_slice()));
                    }
                    Write::Delete { name } => {
                        names.insert(name.as_str(), None);
                    }
                    Write::DeleteRange { start, end } => {
                        let end = end.as_deref();
                        if end.is_some_and(|end| end <= start.as_str()) {
                            continue;
                        }
                        names.retain(|n, _| *n < start.as_str() || end.is_some_and(|e| *n >= e));
                        batch.ranges.push((module, key, start.as_str(), end));
                    }
                    Write::SetAlarm { name, at_ms } => {
                        let row = (commit.fence.partition, module, key, name.as_str());
                        batch.alarms.insert(row, Some(*at_ms));
                    }
                    Write::CancelAlarm { name } => {
                        let row = (commit.fence.partition, module, key, name.as_str());
                        batch.alarms.insert(row, None);
                    }
                }
            }
        }
        batch
    }

    /// Run the batch's statements (pipelined: they run in the order sent).
    async fn apply(
        &self,
        tx: &Transaction<'_>,
        st: &Statements,
        ns: &str,
    ) -> Result<(), tokio_postgres::Error> {
        let (mut r_mod, mut r_key, mut r_lo, mut r_hi) = (vec![], vec![], vec![], vec![]);
        for (module, key, start, end) in &self.ranges {
            r_mod.push(*module);
            r_key.push(*key);
            r_lo.push(start.as_bytes());
            r_hi.push(end.map(str::as_bytes));
        }
        let (mut d_mod, mut d_key, mut d_name) = (vec![], vec![], vec![]);
        let (mut p_mod, mut p_key, mut p_name, mut p_value) = (vec![], vec![], vec![], vec![]);
        for ((module, key), names) in &self.names {
            for (name, value) in names {
                match value {
                    None => {
                        d_mod.push(*module);
                        d_key.push(*key);
                        d_name.push(name.as_bytes());
                    }
                    Some(value) => {
                        p_mod.push(*module);
                        p_key.push(*key);
                        p_name.push(name.as_bytes());
                        p_value.push(*value);
                    }
                }
            }
        }
        let (mut ad_p, mut ad_mod, mut ad_key, mut ad_name) = (vec![], vec![], vec![], vec![]);
        let (mut as_p, mut as_mod, mut as_key, mut as_name, mut as_at) =
            (vec![], vec![], vec![], vec![], vec![]);
        for ((partition, module, key, name), at) in &self.alarms {
            match at {
                None => {
                    ad_p.push(*partition as i32);
                    ad_mod.push(*module);
                    ad_key.push(*key);
                    ad_name.push(name.as_bytes());
                }
                Some(at) => {
                    as_p.push(*partition as i32);
                    as_mod.push(*module);
                    as_key.push(*key);
                    as_name.push(name.as_bytes());
                    as_at.push(stored(*at));
                }
            }
        }
        let ranges: [&(dyn ToSql + Sync); 5] = [&ns, &r_mod, &r_key, &r_lo, &r_hi];
        let alarm_deletes: [&(dyn ToSql + Sync); 5] = [&ns, &ad_p, &ad_mod, &ad_key, &ad_name];
        let alarm_sets: [&(dyn ToSql + Sync); 6] = [&ns, &as_p, &as_mod, &as_key, &as_name, &as_at];
        let deletes: [&(dyn ToSql + Sync); 4] = [&ns, &d_mod, &d_key, &d_name];
        let puts: [&(dyn ToSql + Sync); 5] = [&ns, &p_mod, &p_key, &p_name, &p_value];
        let mut pending = Vec::new();
        if !r_mod.is_empty() {
            pending.push(tx.execute(&st.delete_ranges, &ranges));
        }
        if !d_mod.is_empty() {
            pending.push(tx.execute(&st.delete_names, &deletes));
        }
        if !p_mod.is_empty() {
            pending.push(tx.execute(&st.upsert, &puts));
        }
        if !ad_p.is_empty() {
            pending.push(tx.execute(&st.delete_alarms, &alarm_deletes));
        }
        if !as_p.is_empty() {
            pending.push(tx.execute(&st.upsert_alarms, &alarm_sets));
        }
        futures_util::future::try_join_all(pending).await?;
        Ok(())
    }
}

/// A token or an alarm's time as stored (`bigint`): the same 64 bits
/// (tokens are table epochs and times are milliseconds, both far below
/// 2^63, so signed order is theirs).
fn stored(value: u64) -> i64 {
    value as i64
}

/// One round in the transaction `tx` (see the module docs).
async fn run_round(
    tx: &Transaction<'_>,
    st: &Statements,
    ns: &str,
    round: &Round,
) -> Result<RoundResult, tokio_postgres::Error> {
    let partitions: Vec<i32> = plan::partitions(round)
        .into_iter()
        .map(|p| p as i32)
        .collect();
    let (_, rows) = futures_util::future::try_join(
        tx.execute(&st.insert_fences, &[&ns, &partitions]),
        tx.query(&st.lock_fences, &[&ns, &partitions]),
    )
    .await?;
    let tokens = rows
        .iter()
        .map(|r| (r.get::<_, i32>(0) as u32, r.get::<_, i64>(1) as u64))
        .collect();
    let decisions = plan::decide(round, &tokens);

    let (raised_p, raised_t): (Vec<i32>, Vec<i64>) = decisions
        .raised
        .iter()
        .map(|(p, t)| (*p as i32, stored(*t)))
        .unzip();
    let tenants = plan::landed_tenants(round, &decisions);
    let batch = Batch::of(round, &decisions);
    let raise = async {
        if !raised_p.is_empty() {
            tx.execute(&st.raise_fences, &[&ns, &raised_p, &raised_t])
                .await?;
        }
        Ok::<_, tokio_postgres::Error>(())
    };
    let lock_usage = async {
        if tenants.is_empty() {
            return Ok(Vec::new());
        }
        tx.execute(&st.insert_usage, &[&ns, &tenants]).await?;
        tx.query(&st.lock_usage, &[&ns, &tenants]).await
    };
    let (_, _, rows) =
        futures_util::future::try_join3(raise, batch.apply(tx, st, ns), lock_usage).await?;
    let mut usage: BTreeMap<String, u64> = rows
        .iter()
        .map(|r| (r.get(0), r.get::<_, i64>(1).max(0) as u64))
        .collect();
    let after = plan::usage_after(round, &decisions, &mut usage);
    let (u_tenant, u_bytes): (Vec<&str>, Vec<i64>) = usage
        .iter()
        .map(|(t, b)| (t.as_str(), (*b).min(i64::MAX as u64) as i64))
        .unzip();

    let served: Vec<(u32, &KeyScope)> = round
        .loads
        .iter()
        .zip(&decisions.loads)
        .filter(|(_, stale)| stale.is_none())
        .map(|(l, _)| (l.fence.partition, &l.scope))
        .collect();
    let mut others: Vec<&str> = served
        .iter()
        .map(|(_, s)| s.tenant())
        .filter(|t| !usage.contains_key(*t))
        .collect();
    others.sort_unstable();
    others.dedup();
    let (l_mod, l_key): (Vec<&str>, Vec<&str>) = served
        .iter()
        .map(|(_, s)| (s.module.as_str(), s.key.as_str()))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .unzip();
    let (mut la_p, mut la_mod, mut la_key) = (vec![], vec![], vec![]);
    for (p, module, key) in served
        .iter()
        .map(|(p, s)| (*p as i32, s.module.as_str(), s.key.as_str()))
        .collect::<std::collections::BTreeSet<_>>()
    {
        la_p.push(p);
        la_mod.push(module);
        la_key.push(key);
    }
    let alarm_partitions: Vec<i32> = decisions
        .alarm_partitions(round)
        .into_iter()
        .map(|p| p as i32)
        .collect();
    let set_usage = async {
        if !u_tenant.is_empty() {
            tx.execute(&st.set_usage, &[&ns, &u_tenant, &u_bytes])
                .await?;
        }
        Ok::<_, tokio_postgres::Error>(())
    };
    let read_usage = async {
        if others.is_empty() {
            return Ok(Vec::new());
        }
        tx.query(&st.read_usage, &[&ns, &others]).await
    };
    let read_entries = async {
        if l_mod.is_empty() {
            return Ok(Vec::new());
        }
        tx.query(&st.read_entries, &[&ns, &l_mod, &l_key]).await
    };
    let read_key_alarms = async {
        if la_p.is_empty() {
            return Ok(Vec::new());
        }
        let params: [&(dyn ToSql + Sync); 4] = [&ns, &la_p, &la_mod, &la_key];
        tx.query(&st.read_key_alarms, &params).await
    };
    let read_partition_alarms = async {
        if alarm_partitions.is_empty() {
            return Ok(Vec::new());
        }
        tx.query(&st.read_partition_alarms, &[&ns, &alarm_partitions])
            .await
    };
    let (_, usage_rows, entry_rows, key_alarm_rows, partition_alarm_rows) =
        futures_util::future::try_join5(
            set_usage,
            read_usage,
            read_entries,
            read_key_alarms,
            read_partition_alarms,
        )
        .await?;
    for r in usage_rows {
        usage.insert(r.get(0), r.get::<_, i64>(1).max(0) as u64);
    }
    let mut entries: BTreeMap<(String, String), Entries> = BTreeMap::new();
    for r in entry_rows {
        entries
            .entry((r.get(0), r.get(1)))
            .or_default()
            .push((name_of(r.get(2)), r.get(3)));
    }
    let mut key_alarms: BTreeMap<(u32, String, String), Vec<(String, u64)>> = BTreeMap::new();
    for alarm in key_alarm_rows.into_iter().map(alarm_of) {
        let AlarmId {
            partition,
            module,
            key,
            name,
        } = alarm.id;
        key_alarms
            .entry((partition, module, key))
            .or_default()
            .push((name, alarm.at_ms));
    }
    let mut by_partition: BTreeMap<u32, Vec<StoredAlarm>> = BTreeMap::new();
    for alarm in partition_alarm_rows.into_iter().map(alarm_of) {
        by_partition
            .entry(alarm.id.partition)
            .or_default()
            .push(alarm);
    }
    for alarms in by_partition.values_mut() {
        alarms.sort_unstable();
    }
    let loaded = served.into_iter().map(|(partition, scope)| Loaded {
        entries: entries
            .get(&(scope.module.clone(), scope.key.clone()))
            .cloned()
            .unwrap_or_default(),
        alarms: key_alarms
            .get(&(partition, scope.module.clone(), scope.key.clone()))
            .cloned()
            .unwrap_or_default(),
        tenant_bytes: usage.get(scope.tenant()).copied().unwrap_or(0),
    });
    let alarms = decisions
        .alarm_partitions(round)
        .into_iter()
        .map(|p| by_partition.get(&p).cloned().unwrap_or_default());
    Ok(plan::result(&decisions, after, loaded, alarms))
}

/// An alarm row as read: (partition, module, key, name, at_ms).
fn alarm_of(row: tokio_postgres::Row) -> StoredAlarm {
    StoredAlarm {
        id: AlarmId {
            partition: row.get::<_, i32>(0) as u32,
            module: row.get(1),
            key: row.get(2),
            name: name_of(row.get(3)),
        },
        at_ms: row.get::<_, i64>(4).max(0) as u64,
    }
}

impl Backend for PostgresBackend {
    fn describe(&self) -> String {
        format!("postgres {} (namespace {})", self.location, self.namespace)
    }

    fn round(&self, round: Round) -> BoxFuture<'_, Result<RoundResult, BackendError>> {
        Box::pin(async move {
            if round.is_empty() {
                return Ok(RoundResult::default());
            }
            match self.with(Op::Round(&round)).await? {
                Answer::Round(result) => Ok(result),
                _ => unreachable!("a round answers a round"),
            }
        })
    }

    fn read(
        &self,
        scope: KeyScope,
        prefix: String,
        limit: u32,
    ) -> BoxFuture<'_, Result<Entries, BackendError>> {
        Box::pin(async move {
            match self.with(Op::Read(&scope, &prefix, limit)).await? {
                Answer::Read(entries) => Ok(entries),
                _ => unreachable!("a read answers a read"),
            }
        })
    }

    fn read_alarms(
        &self,
        scope: KeyScope,
        partition: u32,
    ) -> BoxFuture<'_, Result<Vec<(String, u64)>, BackendError>> {
        Box::pin(async move {
            match self.with(Op::ReadAlarms(&scope, partition)).await? {
                Answer::Alarms(alarms) => Ok(alarms),
                _ => unreachable!("an alarm read answers alarms"),
            }
        })
    }

    fn highest_fence_token(&self) -> BoxFuture<'_, Result<u64, BackendError>> {
        Box::pin(async move {
            match self.with(Op::HighestFence).await? {
                Answer::Token(token) => Ok(token),
                _ => unreachable!("a token query answers a token"),
            }
        })
    }
}
