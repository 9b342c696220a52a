//! One NATS client connection as a translator, without I/O: protocol text
//! from the client becomes efabus frames for the broker, and the broker's
//! frames become protocol text for the client.
//!
//! What the client sends is parsed as NATS documents its client protocol:
//! `CONNECT {json}`, `PUB subject [reply] size`, `HPUB subject [reply]
//! header_size total_size`, `SUB subject [queue] sid`, `UNSUB sid [max]`,
//! `PING`, `PONG` (verbs in any case, fields separated by spaces or tabs,
//! lines ended by CRLF or LF). The broker sees an ordinary client: a
//! hello, publishes, subscriptions (the client's sid strings are mapped to
//! efabus's numbers here), pings. Its messages go out as `MSG` or `HMSG`,
//! its errors as `-ERR` with NATS's texts, its pings as `PING`.
//!
//! Anything malformed ends the connection with a `-ERR` saying why; no
//! input makes this panic, and what it buffers for a client is bounded by
//! the control line limit and the largest payload.

use std::collections::{HashMap, VecDeque};

use bytes::{Buf, Bytes, BytesMut};
use efabus_core::codec::{self, CodecLimits, FrameKind, RoutedFields};
use efabus_core::frame::{DeliveryClass, ErrorFrame};
use efabus_core::frame::{ErrorCode, Frame, Hello, Subscribe, PROTOCOL_VERSION};
use efabus_core::headers;
use efabus_core::transport::split_run_slices;
use rustc_hash::FxHashMap;
use serde::Deserialize;

/// Longest CONNECT line: its JSON may carry long credentials (the broker
/// holds a peer that has not logged in to the same bound).
pub const MAX_CONNECT_LINE: usize = 32 << 10;
/// Server pings a client may leave unanswered before it is dropped as
/// stale (NATS's `ping_max` default).
pub const DEFAULT_MAX_PINGS_OUT: usize = 2;
/// Longest other protocol line (NATS's `max_control_line` default).
pub const DEFAULT_MAX_CONTROL_LINE: usize = 4096;

/// What the listener tells every client in its `INFO`, and the limits it
/// holds clients to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerInfo {
    /// The server's id (stable while it runs).
    pub server_id: String,
    /// The server's name.
    pub server_name: String,
    /// The efabus version.
    pub version: String,
    /// Largest payload (headers included) of one publish.
    pub max_payload: usize,
    /// Whether a CONNECT must carry credentials.
    pub auth_required: bool,
    /// Server pings a client may leave unanswered.
    pub max_pings_out: usize,
    /// Longest protocol line other than CONNECT.
    pub max_control_line: usize,
    /// Most subscriptions one client may hold (the broker's
    /// `limits.max_subscriptions_per_peer`).
    pub max_subscriptions: usize,
    /// Clients must speak TLS (after reading `INFO`).
    pub tls_required: bool,
    /// Clients must present a certificate the server verifies.
    pub tls_verify: bool,
    /// Clients start TLS before reading `INFO`, which goes through it
    /// (NATS's "TLS first"); not announced.
    pub handshake_first: bool,
}

impl Default for ServerInfo {
    fn default() -> Self {
        ServerInfo {
            server_id: String::new(),
            server_name: String::new(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            max_payload: codec::DEFAULT_MAX_PAYLOAD,
            auth_required: false,
            max_pings_out: DEFAULT_MAX_PINGS_OUT,
            max_control_line: DEFAULT_MAX_CONTROL_LINE,
            max_subscriptions: 100_000,
            tls_required: false,
            tls_verify: false,
            handshake_first: false,
        }
    }
}

impl ServerInfo {
    /// The `INFO` line a new client gets.
    pub fn info_line(&self, client_id: u64, host: &str, port: u16, client_ip: &str) -> String {
        let mut info = serde_json::json!({
            "server_id": self.server_id,
            "server_name": self.server_name,
            "version": self.version,
            "proto": 1,
            "host": host,
            "port": port,
            "headers": true,
            "max_payload": self.max_payload,
            "auth_required": self.auth_required,
            "client_id": client_id,
            "client_ip": client_ip,
        });
        if self.tls_required {
            info["tls_required"] = true.into();
        }
        if self.tls_verify {
            info["tls_verify"] = true.into();
        }
        format!("INFO {info}\r\n")
    }
}

/// The fields of a CONNECT that efabus reads; others are ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Connect {
    verbose: bool,
    pedantic: bool,
    echo: Option<bool>,
    headers: bool,
    no_responders: bool,
    name: Option<String>,
    lang: Option<String>,
    version: Option<String>,
    user: Option<String>,
    pass: Option<String>,
    auth_token: Option<String>,
}

/// Why a connection ends: the `-ERR` text NATS uses, already written for
/// the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fatal(pub String);

/// Broker pings a client may have waiting in its output at most, however
/// slowly it reads.
const MAX_PINGS_QUEUED: usize = 64;

/// SUBs a client may have on their way to the broker's verdict beyond its
/// subscription limit.
const MAX_SUBS_AWAITING_VERDICT: usize = 1024;

/// An operation waiting for the broker's verdict (see `verdicts`).
#[derive(Debug, Clone, Copy)]
struct Verdict {
    /// The ping sent behind it.
    nonce: u64,
    /// `+OK` is owed to the client (`verbose`) unless it is refused.
    owes_ok: bool,
    /// The subscription a SUB made: forgotten if the broker refuses it.
    sub: Option<u64>,
}

/// A subscription as the client named it.
#[derive(Debug)]
struct Sub {
    /// The client's sid, as it wrote it.
    name: String,
    /// Its subject pattern: a refusal names it.
    pattern: String,
    /// Deliveries written here before the broker began counting them
    /// against a limit (`Frame::UnsubscribeAfter` counts from the first
    /// such frame): 0 for a queue group's member, counted from its SUB;
    /// `None` before a plain subscription's first `UNSUB sid max`.
    counted_from: Option<u64>,
    /// Auto-unsubscribe after this many deliveries (`UNSUB sid max`).
    max: Option<u64>,
    delivered: u64,
}

/// A PUB or HPUB line read, waiting for its payload.
#[derive(Debug)]
struct PendingPub {
    subject: String,
    reply: Option<String>,
    /// Header bytes at the start of the payload (HPUB), if any.
    header_len: Option<usize>,
    total: usize,
}

/// Most fields an operation takes (HPUB: subject, reply, two sizes).
const MAX_ARGS: usize = 4;
/// Longest sid a client may give a subscription.
const MAX_SID_LEN: usize = 128;

/// A PUB or HPUB line, borrowed from the input.
#[derive(Debug)]
struct PubLine<'l> {
    subject: &'l str,
    reply: Option<&'l str>,
    header_len: Option<usize>,
    total: usize,
}

/// The fields of a PUB or HPUB line, checked against the payload limit.
fn pub_line<'l>(
    args: &[&'l str],
    with_headers: bool,
    max_payload: usize,
) -> Result<PubLine<'l>, Fatal> {
    let (subject, reply, head, total) = match (with_headers, args) {
        (false, [subject, total]) => (*subject, None, None, total),
        (false, [subject, reply, total]) => (*subject, Some(*reply), None, total),
        (true, [subject, head, total]) => (*subject, None, Some(*head), total),
        (true, [subject, reply, head, total]) => (*subject, Some(*reply), Some(*head), total),
        _ => return Err(fatal("Parser Error")),
    };
    let total = size(total).ok_or_else(|| fatal("Parser Error"))?;
    let header_len = match head {
        Some(text) => Some(size(text).ok_or_else(|| fatal("Parser Error"))?),
        None => None,
    };
    if header_len.is_some_and(|head| head > total) {
        return Err(fatal("Parser Error"));
    }
    if total > max_payload {
        return Err(fatal("Maximum Payload Violation"));
    }
    Ok(PubLine {
        subject,
        reply,
        header_len,
        total,
    })
}

/// The `total` payload bytes at the start of `rest`, once they and their
/// CRLF have all arrived (`None` until then).
fn payload_of(rest: &[u8], total: usize) -> Result<Option<&[u8]>, Fatal> {
    let Some(data) = rest.get(..total + 2) else {
        return Ok(None);
    };
    if !data.ends_with(b"\r\n") {
        return Err(fatal("Parser Error"));
    }
    Ok(Some(&data[..total]))
}

/// One client connection's protocol state.
#[derive(Debug)]
pub struct NatsSession {
    info: ServerInfo,
    /// CONNECT read (or implied: a server without auth takes other
    /// operations first, as NATS does).
    connected: bool,
    /// The broker accepted the CONNECT. Until then nothing after it is
    /// read: what a client sends is held to the CONNECT line's bound
    /// before it has logged in, and nothing runs ahead of the verdict.
    welcomed: bool,
    /// The welcome came since the owner last asked (see `take_resumed`).
    resumed: bool,
    verbose: bool,
    /// The client asked to be told of publishes to invalid subjects
    /// (`pedantic`); others are not, as NATS servers accept them.
    pedantic: bool,
    /// The client reads HMSG.
    headers: bool,
    subs: FxHashMap<u64, Sub>,
    by_name: HashMap<String, u64>,
    next_sid: u64,
    /// Nonces of the broker's pings the client has not answered yet, each
    /// with whether it came while the client's input was not read (its
    /// answer may be waiting unread: it does not count towards staleness).
    broker_pings: VecDeque<(u64, bool)>,
    /// The owner is not reading the client's input now (the broker paused
    /// it).
    reads_held: bool,
    next_nonce: u64,
    /// The pings sent to the broker behind operations whose verdict
    /// matters here, in order: every operation it may refuse under
    /// `verbose`, every SUB. The broker handles a connection's frames in
    /// order, so an error that comes before the first one's answer is
    /// that operation's.
    verdicts: VecDeque<Verdict>,
    /// The broker refused the operation whose verdict comes next.
    refused: bool,
    pending: Option<PendingPub>,
    /// The subject of the last message delivered, which the next one
    /// usually has too.
    last_subject: String,
    /// The start of the last message's line (`MSG <subject> <sid>`), and
    /// the subscription and kind it was for; its subject is
    /// `last_subject`.
    line_start: Vec<u8>,
    line_start_for: Option<(u64, bool)>,
    /// Frames for the broker are built here and split off, so many share
    /// one allocation.
    scratch: BytesMut,
    limits: CodecLimits,
}

impl NatsSession {
    /// A connection's state before anything was read.
    pub fn new(info: ServerInfo) -> Self {
        NatsSession {
            info,
            connected: false,
            welcomed: false,
            resumed: false,
            verbose: false,
            pedantic: false,
            headers: false,
            subs: FxHashMap::default(),
            by_name: HashMap::new(),
            next_sid: 1,
            broker_pings: VecDeque::new(),
            reads_held: false,
            next_nonce: 1,
            verdicts: VecDeque::new(),
            refused: false,
            pending: None,
            last_subject: String::new(),
            line_start: Vec::new(),
            line_start_for: None,
            scratch: BytesMut::new(),
            limits: CodecLimits {
                max_frame: usize::MAX,
                max_subject_len: u16::MAX as usize,
            },
        }
    }

    /// Limits a reload changed: the subscriptions this client may hold
    /// from now on (those it holds stay), and the largest payload.
    pub fn set_limits(&mut self, max_subscriptions: usize, max_payload: usize) {
        self.info.max_subscriptions = max_subscriptions;
        self.info.max_payload = max_payload;
    }

    /// Subscriptions the client holds.
    pub fn subscriptions(&self) -> usize {
        self.subs.len()
    }

    /// Whether operations after the CONNECT wait for the broker's verdict.
    pub fn holding(&self) -> bool {
        self.connected && !self.welcomed
    }

    /// Whether the broker accepted the client's CONNECT: until then it is
    /// held to what a CONNECT line needs.
    pub fn welcomed(&self) -> bool {
        self.welcomed
    }

    /// Whether the broker's welcome came since the last call: the input
    /// held behind the CONNECT may be read on.
    pub fn take_resumed(&mut self) -> bool {
        std::mem::take(&mut self.resumed)
    }

    /// Read every whole operation at the front of `input` (what is left
    /// is an incomplete one): frames for the broker go to `to_broker`, and
    /// what the client is answered at once (`PONG` before CONNECT, `+OK`,
    /// `-ERR`) to `to_client`. On `Err` the connection must end after
    /// `to_client` is written.
    pub fn receive(
        &mut self,
        input: &mut BytesMut,
        to_broker: &mut Vec<Bytes>,
        to_client: &mut BytesMut,
    ) -> Result<(), Fatal> {
        let result = self.receive_inner(input, to_broker, to_client);
        if let Err(Fatal(text)) = &result {
            put_err(to_client, text);
            input.clear();
        }
        result
    }

    fn receive_inner(
        &mut self,
        input: &mut BytesMut,
        to_broker: &mut Vec<Bytes>,
        to_client: &mut BytesMut,
    ) -> Result<(), Fatal> {
        // Operations are read in place; what they took is dropped from the
        // buffer once, at the end.
        let mut at = 0;
        let result = self.read_operations(input, &mut at, to_broker, to_client);
        input.advance(at);
        result
    }

    fn read_operations(
        &mut self,
        input: &[u8],
        at: &mut usize,
        to_broker: &mut Vec<Bytes>,
        to_client: &mut BytesMut,
    ) -> Result<(), Fatal> {
        loop {
            if self.holding() {
                return Ok(());
            }
            let rest = &input[*at..];
            if let Some(pending) = self.pending.take() {
                let Some(data) = payload_of(rest, pending.total)? else {
                    self.pending = Some(pending);
                    return Ok(());
                };
                let (subject, reply) = (&pending.subject, pending.reply.as_deref());
                self.publish(subject, reply, pending.header_len, data, to_broker)?;
                *at += pending.total + 2;
                self.ask_verdict(None, to_broker);
                continue;
            }
            let limit = if self.connected {
                self.info.max_control_line
            } else {
                MAX_CONNECT_LINE
            };
            let Some(end) = memchr::memchr(b'\n', rest) else {
                if rest.len() > limit {
                    return Err(fatal("Maximum Control Line Exceeded"));
                }
                return Ok(());
            };
            if end > limit {
                return Err(fatal("Maximum Control Line Exceeded"));
            }
            let line = &rest[..end];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let Some(publish) = self.operation(line, to_broker, to_client)? else {
                *at += end + 1;
                continue;
            };
            // A publish: its payload follows the line, usually in full.
            let Some(data) = payload_of(&rest[end + 1..], publish.total)? else {
                self.pending = Some(PendingPub {
                    subject: publish.subject.to_string(),
                    reply: publish.reply.map(str::to_string),
                    header_len: publish.header_len,
                    total: publish.total,
                });
                *at += end + 1;
                return Ok(());
            };
            let (subject, reply) = (publish.subject, publish.reply);
            self.publish(subject, reply, publish.header_len, data, to_broker)?;
            *at += end + 1 + publish.total + 2;
            self.ask_verdict(None, to_broker);
        }
    }

    /// Handle one protocol line; a PUB or HPUB line comes back for its
    /// payload to be read.
    fn operation<'l>(
        &mut self,
        line: &'l [u8],
        to_broker: &mut Vec<Bytes>,
        to_client: &mut BytesMut,
    ) -> Result<Option<PubLine<'l>>, Fatal> {
        let line = std::str::from_utf8(line).map_err(|_| fatal("Parser Error"))?;
        let line = line.trim_start_matches([' ', '\t']);
        let (verb, rest) = line
            .split_once([' ', '\t'])
            .map_or((line, ""), |(verb, rest)| (verb, rest));
        let is = |name: &str| verb.eq_ignore_ascii_case(name);
        if is("PUB") || is("HPUB") || is("SUB") || is("UNSUB") {
            if !self.connected {
                if self.info.auth_required {
                    return Err(fatal("Authorization Violation"));
                }
                // Without auth, NATS takes operations before CONNECT.
                self.connect("{}", to_broker)?;
            }
            let mut args = [""; MAX_ARGS];
            let mut count = 0;
            for arg in rest.split([' ', '\t']).filter(|arg| !arg.is_empty()) {
                let slot = args.get_mut(count).ok_or_else(|| fatal("Parser Error"))?;
                *slot = arg;
                count += 1;
            }
            let args = &args[..count];
            if is("PUB") || is("HPUB") {
                return pub_line(args, is("HPUB"), self.info.max_payload).map(Some);
            }
            if is("SUB") {
                if let Some(sid) = self.sub_line(args, to_broker, to_client)? {
                    self.ask_verdict(Some(sid), to_broker);
                }
            } else {
                self.unsub_line(args, to_broker)?;
                self.ask_verdict(None, to_broker);
            }
        } else if is("PING") {
            if !self.connected && self.info.auth_required {
                return Err(fatal("Authorization Violation"));
            }
            if self.connected {
                let nonce = self.next_nonce;
                self.next_nonce += 1;
                to_broker.push(control(&Frame::Ping { nonce }));
            } else {
                to_client.extend_from_slice(b"PONG\r\n");
            }
        } else if is("PONG") {
            if let Some((nonce, _)) = self.broker_pings.pop_front() {
                to_broker.push(control(&Frame::Pong { nonce }));
            }
        } else if is("CONNECT") {
            self.connect(rest, to_broker)?;
        } else if !(is("+OK") || is("-ERR") || is("INFO") || verb.is_empty()) {
            // Clients do not send +OK, -ERR or INFO; an echo of them is
            // harmless.
            return Err(fatal("Unknown Protocol Operation"));
        }
        Ok(None)
    }

    fn ok(&self, to_client: &mut BytesMut) {
        if self.verbose {
            to_client.extend_from_slice(b"+OK\r\n");
        }
    }

    /// Under `verbose`, an operation the broker may refuse gets `+OK` only
    /// once the broker has handled it without an error, as NATS servers
    /// answer; and a SUB the broker refuses must be forgotten here, though
    /// its refusal names no sid. A ping behind the operation brings the
    /// verdict.
    fn ask_verdict(&mut self, sub: Option<u64>, to_broker: &mut Vec<Bytes>) {
        if self.verbose || sub.is_some() {
            let nonce = self.next_nonce;
            self.next_nonce += 1;
            self.verdicts.push_back(Verdict {
                nonce,
                owes_ok: self.verbose,
                sub,
            });
            to_broker.push(control(&Frame::Ping { nonce }));
        }
    }

    fn connect(&mut self, json: &str, to_broker: &mut Vec<Bytes>) -> Result<(), Fatal> {
        if self.connected {
            // A second CONNECT changes nothing.
            return Ok(());
        }
        let connect: Connect =
            serde_json::from_str(json.trim()).map_err(|_| fatal("Parser Error"))?;
        self.connected = true;
        self.verbose = connect.verbose;
        self.pedantic = connect.pedantic;
        self.headers = connect.headers;
        let (user, credentials) = match (connect.user, connect.pass, connect.auth_token) {
            (Some(user), pass, _) => (Some(user), pass),
            (None, _, token) => (None, token),
        };
        let name = match (&connect.name, &connect.lang) {
            (Some(name), _) => name.clone(),
            (None, Some(lang)) => format!(
                "nats-{lang}-{}",
                connect.version.as_deref().unwrap_or("client")
            ),
            (None, None) => "nats-client".to_string(),
        };
        to_broker.push(control(&Frame::Hello(Hello {
            version: PROTOCOL_VERSION,
            name,
            user,
            credentials,
            proof: None,
            offers: Vec::new(),
            link_auth: None,
            no_echo: connect.echo == Some(false),
            // The answer is a status in headers: only for clients that
            // read them.
            no_responders: connect.no_responders && connect.headers,
        })));
        Ok(())
    }

    fn publish(
        &mut self,
        subject: &str,
        reply: Option<&str>,
        header_len: Option<usize>,
        data: &[u8],
        to_broker: &mut Vec<Bytes>,
    ) -> Result<(), Fatal> {
        let fields = RoutedFields {
            subject,
            reply,
            headers: header_len.is_some(),
        };
        let need = codec::FRAME_OVERHEAD
            + codec::PUBLISH_HEADER_LEN
            + subject.len()
            + reply.map_or(0, str::len)
            + codec::HEADERS_PREFIX_LEN
            + data.len();
        if self.scratch.capacity() - self.scratch.len() < need {
            self.scratch.reserve(need.max(64 << 10));
        }
        // Only a subject longer than the wire's 64 KiB field fails here;
        // the control line limit keeps them far below it.
        let too_long = |_| fatal("Invalid Subject");
        match header_len {
            Some(head) => {
                headers::check_block(&data[..head]).map_err(|_| fatal("Parser Error"))?;
                // The payload field: the block's length, then the block and
                // the body as they came.
                let field_len = codec::HEADERS_PREFIX_LEN + data.len();
                let kind = FrameKind::Publish;
                codec::routed_head_into(&mut self.scratch, kind, 0, 0, fields, field_len)
                    .map_err(too_long)?;
                // `head` is at most the payload limit, a u32.
                self.scratch
                    .extend_from_slice(&u32::try_from(head).unwrap_or(u32::MAX).to_le_bytes());
                self.scratch.extend_from_slice(data);
            }
            None => codec::routed_into(&mut self.scratch, FrameKind::Publish, 0, fields, data)
                .map_err(too_long)?,
        }
        to_broker.push(self.scratch.split().freeze());
        Ok(())
    }

    fn sub_line(
        &mut self,
        args: &[&str],
        to_broker: &mut Vec<Bytes>,
        to_client: &mut BytesMut,
    ) -> Result<Option<u64>, Fatal> {
        let (pattern, queue, name) = match args {
            [pattern, name] => (pattern, None, name),
            [pattern, queue, name] => (pattern, Some(queue), name),
            _ => return Err(fatal("Parser Error")),
        };
        if name.len() > MAX_SID_LEN {
            return Err(fatal("Parser Error"));
        }
        // The broker holds the client to its limit, and the SUBs it refuses
        // are forgotten here at their verdicts; this bounds the map of sids
        // while verdicts are on their way.
        let room = self
            .info
            .max_subscriptions
            .saturating_add(MAX_SUBS_AWAITING_VERDICT);
        if self.subs.len() >= room && !self.by_name.contains_key(*name) {
            put_err(to_client, "Maximum Subscriptions Exceeded");
            return Ok(None);
        }
        // A sid used again replaces its subscription.
        if let Some(old) = self.by_name.remove(*name) {
            self.subs.remove(&old);
            to_broker.push(control(&Frame::Unsubscribe { sid: old }));
        }
        let sid = self.next_sid;
        self.next_sid += 1;
        self.by_name.insert(name.to_string(), sid);
        self.subs.insert(
            sid,
            Sub {
                name: name.to_string(),
                pattern: pattern.to_string(),
                counted_from: queue.map(|_| 0),
                max: None,
                delivered: 0,
            },
        );
        to_broker.push(control(&Frame::Subscribe(Subscribe {
            sid,
            pattern: pattern.to_string(),
            queue: queue.map(|queue| queue.to_string()),
            class: DeliveryClass::Reliable,
        })));
        if queue.is_some() {
            // Counted by the broker from here: a maximum set later holds
            // with the messages on their way here counted too.
            let total = u64::MAX;
            to_broker.push(control(&Frame::UnsubscribeAfter { sid, total }));
        }
        Ok(Some(sid))
    }

    fn unsub_line(&mut self, args: &[&str], to_broker: &mut Vec<Bytes>) -> Result<(), Fatal> {
        let (name, max) = match args {
            [name] => (name, None),
            [name, max] => (name, Some(count(max).ok_or_else(|| fatal("Parser Error"))?)),
            _ => return Err(fatal("Parser Error")),
        };
        let Some(&sid) = self.by_name.get(*name) else {
            // NATS ignores an unknown sid.
            return Ok(());
        };
        match (max, self.subs.get_mut(&sid)) {
            (Some(max), Some(sub)) if sub.delivered < max => {
                sub.max = Some(max);
                // The broker counts them too, as it routes: a queue
                // group's messages past the maximum go to other members.
                // A queue member's deliveries are counted from its SUB,
                // another's from its first maximum.
                let from = *sub.counted_from.get_or_insert(sub.delivered);
                let total = max - from;
                to_broker.push(control(&Frame::UnsubscribeAfter { sid, total }));
            }
            _ => self.end_sub(sid, to_broker),
        }
        Ok(())
    }

    fn end_sub(&mut self, sid: u64, to_broker: &mut Vec<Bytes>) {
        if self.forget_sub(sid) {
            to_broker.push(control(&Frame::Unsubscribe { sid }));
        }
    }

    /// Drops subscription `sid` here; its name stays if a later SUB took it.
    fn forget_sub(&mut self, sid: u64) -> bool {
        let Some(sub) = self.subs.remove(&sid) else {
            return false;
        };
        if self.by_name.get(&sub.name) == Some(&sid) {
            self.by_name.remove(&sub.name);
        }
        true
    }

    /// Whether the owner reads the client's input now: while it does not
    /// (the broker paused it), the client's answers to pings wait unread
    /// and its silence is not held against it.
    pub fn set_reads_held(&mut self, held: bool) {
        self.reads_held = held;
    }

    /// Translate one frame from the broker (a run is taken apart). Frames
    /// the client has no use for (the broker's challenge, drop reports)
    /// are left out. `Err` when the connection must end once `to_client`
    /// is written.
    pub fn deliver(
        &mut self,
        frame: &[u8],
        to_client: &mut BytesMut,
        to_broker: &mut Vec<Bytes>,
    ) -> Result<(), Fatal> {
        if frame.get(codec::PREFIX_LEN) != Some(&(FrameKind::Run as u8)) {
            return self.deliver_one(frame, to_client, to_broker);
        }
        // Runs hold no runs: one level is taken apart.
        let run = frame.get(codec::FRAME_OVERHEAD..).unwrap_or_default();
        self.deliver_run(run, to_client, to_broker).map(|_| ())
    }

    /// Translate the whole frames of a run (frames back to back, as the
    /// broker hands them to an endpoint's `send_run`), read in place.
    /// Returns where the whole frames end: less than `run.len()` when
    /// something trails them.
    pub fn deliver_run(
        &mut self,
        run: &[u8],
        to_client: &mut BytesMut,
        to_broker: &mut Vec<Bytes>,
    ) -> Result<usize, Fatal> {
        let mut frames = split_run_slices(run);
        for frame in frames.by_ref() {
            self.deliver_one(frame, to_client, to_broker)?;
        }
        Ok(frames.offset())
    }

    fn deliver_one(
        &mut self,
        frame: &[u8],
        to_client: &mut BytesMut,
        to_broker: &mut Vec<Bytes>,
    ) -> Result<(), Fatal> {
        if frame.get(codec::PREFIX_LEN) == Some(&(FrameKind::Message as u8)) {
            self.message(frame, to_client, to_broker);
            return Ok(());
        }
        // Control frames are few: decoded from a copy.
        self.control_frame(&Bytes::copy_from_slice(frame), to_client)
    }

    fn message(&mut self, frame: &[u8], to_client: &mut BytesMut, to_broker: &mut Vec<Bytes>) {
        // A stream on one subject is checked once, not per message.
        let known = std::mem::take(&mut self.last_subject);
        let Ok(Some(view)) = codec::peek_routed_known(frame, &self.limits, &known) else {
            self.last_subject = known;
            return;
        };
        let Some(sub) = self.subs.get_mut(&view.sid) else {
            // Unsubscribed meanwhile.
            self.last_subject = known;
            return;
        };
        sub.delivered += 1;
        let (block, body) = match view.headers_and_body() {
            (Some(block), body) if self.headers => (Some(block), body),
            (_, body) => (None, body),
        };
        let total = block.map_or(0, <[u8]>::len) + body.len();
        // `MSG <subject> <sid>` is written once per run of messages on one
        // subject for one subscription, and copied for each.
        let same_subject = std::ptr::eq(view.subject, known.as_str());
        let hmsg = block.is_some();
        if !(same_subject && self.line_start_for == Some((view.sid, hmsg))) {
            self.line_start.clear();
            self.line_start
                .extend_from_slice(if hmsg { b"HMSG " } else { b"MSG " });
            self.line_start.extend_from_slice(view.subject.as_bytes());
            self.line_start.push(b' ');
            self.line_start.extend_from_slice(sub.name.as_bytes());
            self.line_start_for = Some((view.sid, hmsg));
        }
        to_client.reserve(self.line_start.len() + total + 64);
        to_client.extend_from_slice(&self.line_start);
        if let Some(reply) = view.reply {
            to_client.extend_from_slice(b" ");
            to_client.extend_from_slice(reply.as_bytes());
        }
        if let Some(block) = block {
            to_client.extend_from_slice(b" ");
            put_decimal(to_client, block.len() as u64);
        }
        to_client.extend_from_slice(b" ");
        put_decimal(to_client, total as u64);
        to_client.extend_from_slice(b"\r\n");
        if let Some(block) = block {
            to_client.extend_from_slice(block);
        }
        to_client.extend_from_slice(body);
        to_client.extend_from_slice(b"\r\n");
        let ended = sub.max.is_some_and(|max| sub.delivered >= max);
        let sid = view.sid;
        if !std::ptr::eq(view.subject, known.as_str()) {
            self.last_subject = view.subject.to_string();
        } else {
            self.last_subject = known;
        }
        if ended {
            self.end_sub(sid, to_broker);
        }
    }

    fn control_frame(&mut self, frame: &Bytes, to_client: &mut BytesMut) -> Result<(), Fatal> {
        let Ok(decoded) = codec::decode(frame.clone(), &self.limits) else {
            return Ok(());
        };
        match decoded {
            Frame::Welcome(welcome) => {
                if let Ok(max) = usize::try_from(welcome.max_payload) {
                    self.info.max_payload = self.info.max_payload.min(max);
                }
                self.welcomed = true;
                self.resumed = true;
                self.ok(to_client);
            }
            Frame::Ping { nonce } => {
                // Pings still in the output, behind what the client has not
                // read yet, cannot have been answered: only a client that
                // has everything sent to it and does not answer is stale. A
                // slow reader meets the slow-consumer policy instead, and
                // one that reads nothing the broker's heartbeat timeout.
                // Nor is one whose answers this side is not reading (the
                // broker holds it back under `block`): the pings sent
                // meanwhile are not counted against it.
                let unanswered = self.broker_pings.len();
                let counted = self.broker_pings.iter().filter(|(_, held)| !held).count();
                if unanswered >= MAX_PINGS_QUEUED
                    || (!self.reads_held
                        && counted >= self.info.max_pings_out
                        && to_client.is_empty())
                {
                    return Err(err_to(to_client, "Stale Connection"));
                }
                self.broker_pings.push_back((nonce, self.reads_held));
                to_client.extend_from_slice(b"PING\r\n");
            }
            Frame::Pong { nonce } if self.verdicts.front().map(|v| v.nonce) == Some(nonce) => {
                let verdict = self.verdicts.pop_front();
                let refused = std::mem::take(&mut self.refused);
                if verdict.is_some_and(|verdict| verdict.owes_ok) && !refused {
                    to_client.extend_from_slice(b"+OK\r\n");
                }
            }
            Frame::Pong { .. } => to_client.extend_from_slice(b"PONG\r\n"),
            Frame::Error(error) => {
                let text = nats_error(&error);
                if error.fatal {
                    return Err(err_to(to_client, &text));
                }
                if refused_publish_subject(&error) {
                    // NATS servers route such a publish unless the client
                    // is pedantic, and NATS clients close on any other
                    // `-ERR`: the broker has counted it
                    // (`invalid_publishes`), the client is not told.
                    if self.pedantic {
                        put_err(to_client, "Invalid Publish Subject");
                        self.refused |= !self.verdicts.is_empty();
                    }
                    return Ok(());
                }
                // The broker has no subscription for a SUB it refused: it
                // does not count here either. The refusal names no sid,
                // only the pattern: the SUB is the operation whose verdict
                // comes next if that is its pattern; else (a SUB the
                // broker took up later, under an inbox it waited for) the
                // one SUB holding it, and no verdict is the refusal's.
                let mut for_next = true;
                if refused_subscription(&error) {
                    let names = |sub: &Sub| refusal_names(&error, &sub.pattern);
                    let holds = |sid: &u64| self.subs.get(sid).is_some_and(names);
                    let next = self.verdicts.front().and_then(|verdict| verdict.sub);
                    let refused = match next.filter(holds) {
                        Some(sid) => Some(sid),
                        None => {
                            for_next = false;
                            let mut holding = self.subs.iter().filter(|(_, sub)| names(sub));
                            match (holding.next(), holding.next()) {
                                (Some((&sid, _)), None) => Some(sid),
                                _ => None,
                            }
                        }
                    };
                    if let Some(sid) = refused {
                        self.forget_sub(sid);
                    }
                }
                put_err(to_client, &text);
                if for_next {
                    self.refused |= !self.verdicts.is_empty();
                }
            }
            Frame::Goodbye(_) => return Err(Fatal("server shutting down".to_string())),
            _ => {}
        }
        Ok(())
    }
}

/// The text NATS clients know for an efabus error.
fn nats_error(error: &ErrorFrame) -> String {
    match error.code {
        ErrorCode::Auth => "Authorization Violation".to_string(),
        ErrorCode::PayloadTooLarge => "Maximum Payload Violation".to_string(),
        ErrorCode::InvalidSubject => "Invalid Subject".to_string(),
        ErrorCode::TooManySubscriptions => "Maximum Subscriptions Exceeded".to_string(),
        ErrorCode::TooManyConnections => "Maximum Connections Exceeded".to_string(),
        ErrorCode::HandshakeTimeout => "Authentication Timeout".to_string(),
        ErrorCode::SlowConsumer => "Slow Consumer".to_string(),
        ErrorCode::Malformed | ErrorCode::Protocol => "Unknown Protocol Operation".to_string(),
        ErrorCode::PermissionDenied => permission_error(&error.text),
        _ => error.text.replace(['\'', '\r', '\n'], " "),
    }
}

/// Whether the broker refused a publish for its subject or reply subject.
fn refused_publish_subject(error: &ErrorFrame) -> bool {
    error.code == ErrorCode::InvalidSubject && error.text.starts_with("invalid subject ")
}

/// Whether the broker's error refuses a subscription.
fn refused_subscription(error: &ErrorFrame) -> bool {
    match error.code {
        ErrorCode::PermissionDenied => error.text.starts_with("permission denied: subscribe"),
        ErrorCode::InvalidSubject => !refused_publish_subject(error),
        ErrorCode::TooManySubscriptions => true,
        _ => false,
    }
}

/// Whether a subscription refusal is for `pattern`: the broker writes it
/// first, in Rust's debug form (quoted, escaped), or bare at the end of a
/// limit's refusal.
fn refusal_names(error: &ErrorFrame, pattern: &str) -> bool {
    let text = error.text.as_str();
    if error.code == ErrorCode::TooManySubscriptions {
        return text
            .strip_suffix(" refused")
            .and_then(|rest| rest.strip_suffix(pattern))
            .is_some_and(|rest| rest.ends_with("; "));
    }
    let named = [
        "permission denied: subscribe to ",
        "invalid pattern ",
        "cannot subscribe to ",
    ]
    .iter()
    .find_map(|prefix| text.strip_prefix(prefix));
    // Compared as it is formatted, without a copy per subscription tried.
    named.is_some_and(|rest| {
        let mut expected = Prefix(rest);
        std::fmt::Write::write_fmt(&mut expected, format_args!("{pattern:?}")).is_ok()
    })
}

/// Text that must begin with what is written to it: a write that does not
/// match fails.
struct Prefix<'a>(&'a str);

impl std::fmt::Write for Prefix<'_> {
    fn write_str(&mut self, written: &str) -> std::fmt::Result {
        self.0 = self.0.strip_prefix(written).ok_or(std::fmt::Error)?;
        Ok(())
    }
}

/// `Permissions Violation for Publish to "x"` (or `for Subscription to`)
/// from the broker's text, which names the operation and the subject.
fn permission_error(text: &str) -> String {
    let what = text.strip_prefix("permission denied: ").unwrap_or(text);
    let kind = if what.starts_with("subscribe") {
        "Subscription"
    } else {
        "Publish"
    };
    let subject = quoted(what).unwrap_or("");
    format!("Permissions Violation for {kind} to \"{subject}\"")
}

/// The first double-quoted part of a broker's error text (the subject or
/// pattern it names).
fn quoted(text: &str) -> Option<&str> {
    let (_, rest) = text.split_once('"')?;
    rest.split_once('"').map(|(quoted, _)| quoted)
}

fn fatal(text: &str) -> Fatal {
    Fatal(text.to_string())
}

fn err_to(to_client: &mut BytesMut, text: &str) -> Fatal {
    put_err(to_client, text);
    Fatal(text.to_string())
}

fn put_err(to_client: &mut BytesMut, text: &str) {
    to_client.extend_from_slice(b"-ERR '");
    to_client.extend_from_slice(text.as_bytes());
    to_client.extend_from_slice(b"'\r\n");
}

fn control(frame: &Frame) -> Bytes {
    codec::encode(frame).to_bytes()
}

/// A payload size: decimal digits only, within what a publish may hold.
fn size(text: &str) -> Option<usize> {
    let valid = !text.is_empty() && text.len() <= 10 && text.bytes().all(|b| b.is_ascii_digit());
    valid.then(|| text.parse().ok()).flatten()
}

fn count(text: &str) -> Option<u64> {
    let valid = !text.is_empty() && text.len() <= 19 && text.bytes().all(|b| b.is_ascii_digit());
    valid.then(|| text.parse().ok()).flatten()
}

fn put_decimal(out: &mut BytesMut, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use efabus_core::frame::{Goodbye, Message, Welcome};

    fn session() -> NatsSession {
        NatsSession::new(ServerInfo {
            max_payload: 1024,
            ..ServerInfo::default()
        })
    }

    /// The nonces of the pings among `frames`, in order.
    fn pings_in(frames: &[Frame]) -> Vec<u64> {
        frames
            .iter()
            .filter_map(|frame| match frame {
                Frame::Ping { nonce } => Some(*nonce),
                _ => None,
            })
            .collect()
    }

    /// The broker's welcome of a CONNECT.
    pub(in crate::nats) fn welcome(max_payload: u64) -> Frame {
        Frame::Welcome(Welcome {
            version: PROTOCOL_VERSION,
            name: "b".into(),
            offers: Vec::new(),
            max_payload,
            link_auth: None,
            max_subject_len: 512,
            max_subject_tokens: 32,
            proof: None,
        })
    }

    /// Feed `text` as the broker would see it: a CONNECT is welcomed (its
    /// `+OK`, if any, is in the answer) before what follows it is read.
    fn feed(s: &mut NatsSession, text: &[u8]) -> (Vec<Frame>, String, Result<(), Fatal>) {
        feed_as(s, text, true)
    }

    /// Feed `text`, welcoming a CONNECT or not; return the frames for the
    /// broker (decoded) and the answer to the client.
    fn feed_as(
        s: &mut NatsSession,
        text: &[u8],
        welcome_connect: bool,
    ) -> (Vec<Frame>, String, Result<(), Fatal>) {
        let mut input = BytesMut::from(text);
        let (mut frames, mut out) = (Vec::new(), BytesMut::new());
        let mut result = s.receive(&mut input, &mut frames, &mut out);
        while welcome_connect && result.is_ok() && s.holding() {
            let bytes = codec::encode(&welcome(1024)).to_bytes();
            s.deliver(&bytes, &mut out, &mut frames).expect("welcomed");
            assert!(s.take_resumed());
            result = s.receive(&mut input, &mut frames, &mut out);
        }
        let limits = CodecLimits::default();
        let frames = frames
            .into_iter()
            .map(|f| codec::decode(f, &limits).expect("valid frame"))
            .collect();
        (frames, String::from_utf8_lossy(&out).into_owned(), result)
    }

    fn deliver(s: &mut NatsSession, frame: &Frame) -> (String, Vec<Frame>, Result<(), Fatal>) {
        let (mut out, mut frames) = (BytesMut::new(), Vec::new());
        let bytes = codec::encode(frame).to_bytes();
        let result = s.deliver(&bytes, &mut out, &mut frames);
        let limits = CodecLimits::default();
        let frames = frames
            .into_iter()
            .map(|f| codec::decode(f, &limits).expect("valid frame"))
            .collect();
        (String::from_utf8_lossy(&out).into_owned(), frames, result)
    }

    fn message(
        sid: u64,
        subject: &str,
        headers: Option<&'static [u8]>,
        body: &'static [u8],
    ) -> Frame {
        Frame::Message(Message {
            sid,
            subject: subject.into(),
            reply: Some("r.1".into()),
            seq: 0,
            headers: headers.map(Bytes::from_static),
            payload: Bytes::from_static(body),
        })
    }

    #[test]
    fn connect_becomes_a_hello_with_the_credentials_and_options() {
        let mut s = session();
        let line = br#"connect {"verbose":true,"user":"u","pass":"p","echo":false,"headers":true,"no_responders":true,"name":"svc"}"#;
        let mut input = BytesMut::from(&[&line[..], b"\r\nPING\r\n"].concat()[..]);
        let (mut sent, mut out) = (Vec::new(), BytesMut::new());
        assert_eq!(s.receive(&mut input, &mut sent, &mut out), Ok(()));
        assert_eq!(&out[..], b"", "+OK waits for the welcome");
        assert_eq!(sent.len(), 1, "the PING waits behind the CONNECT");
        assert!(s.holding());
        assert_eq!(deliver(&mut s, &welcome(100)).0, "+OK\r\n");
        assert!(s.take_resumed());
        s.receive(&mut input, &mut sent, &mut out).expect("valid");
        let limits = CodecLimits::default();
        let frames: Vec<Frame> = sent
            .into_iter()
            .map(|f| codec::decode(f, &limits).expect("valid frame"))
            .collect();
        let Frame::Hello(hello) = &frames[0] else {
            panic!("{frames:?}")
        };
        assert_eq!(
            (hello.name.as_str(), hello.user.as_deref()),
            ("svc", Some("u"))
        );
        assert_eq!(hello.credentials.as_deref(), Some("p"));
        assert!(hello.no_echo && hello.no_responders);
        assert!(matches!(frames[1], Frame::Ping { nonce: 1 }));
        assert_eq!(deliver(&mut s, &Frame::Pong { nonce: 1 }).0, "PONG\r\n");
        // The welcome's smaller limit holds from now on.
        let (_, out, result) = feed(&mut s, b"PUB a 101\r\n");
        assert_eq!(result, Err(fatal("Maximum Payload Violation")));
        assert_eq!(out, "-ERR 'Maximum Payload Violation'\r\n");
    }

    #[test]
    fn a_token_is_the_credentials_and_echo_stays_on_by_default() {
        let mut s = session();
        let (frames, _, _) = feed(&mut s, b"CONNECT {\"auth_token\":\"t\"}\r\n");
        let Frame::Hello(hello) = &frames[0] else {
            panic!("{frames:?}")
        };
        assert_eq!(
            (hello.user.as_deref(), hello.credentials.as_deref()),
            (None, Some("t"))
        );
        assert!(!hello.no_echo && !hello.no_responders);
    }

    #[test]
    fn publishes_in_pieces_and_in_any_case_become_publish_frames() {
        let mut s = session();
        let mut input = BytesMut::from(&b"CONNECT {}\r\npub a.b r 5\r\nhel"[..]);
        let (mut frames, mut out) = (Vec::new(), BytesMut::new());
        s.receive(&mut input, &mut frames, &mut out).expect("valid");
        let welcomed = codec::encode(&welcome(1024)).to_bytes();
        s.deliver(&welcomed, &mut out, &mut frames)
            .expect("welcomed");
        s.receive(&mut input, &mut frames, &mut out).expect("valid");
        assert_eq!(
            frames.len(),
            1,
            "the hello; the publish waits for its payload"
        );
        input.extend_from_slice(b"lo\r\nHPUB\ta.c  18 20\r\nNATS/1.0\r\nA: b\r\n\r\nhi\r\n");
        s.receive(&mut input, &mut frames, &mut out).expect("valid");
        assert!(input.is_empty());
        let limits = CodecLimits::default();
        let publishes: Vec<Frame> = frames[1..]
            .iter()
            .map(|f| codec::decode(f.clone(), &limits).expect("valid"))
            .collect();
        let [Frame::Publish(plain), Frame::Publish(with)] = &publishes[..] else {
            panic!("{publishes:?}")
        };
        assert_eq!(
            (plain.subject.as_str(), plain.reply.as_deref()),
            ("a.b", Some("r"))
        );
        assert_eq!(
            (&plain.payload[..], plain.headers.as_deref()),
            (&b"hello"[..], None)
        );
        assert_eq!(&with.payload[..], b"hi");
        assert_eq!(
            with.headers.as_deref(),
            Some(&b"NATS/1.0\r\nA: b\r\n\r\n"[..])
        );
    }

    #[test]
    fn subscriptions_map_sids_both_ways_and_stop_at_their_maximum() {
        let mut s = session();
        let (frames, _, _) = feed(
            &mut s,
            b"CONNECT {\"headers\":true}\r\nSUB a.* q alpha\r\nUNSUB alpha 2\r\n",
        );
        let Frame::Subscribe(sub) = &frames[1] else {
            panic!("{frames:?}")
        };
        assert_eq!(
            (sub.pattern.as_str(), sub.queue.as_deref()),
            ("a.*", Some("q"))
        );
        // A queue member: the broker counts its deliveries from the SUB
        // (no limit yet), then the ping that brings the SUB's verdict, and
        // the maximum, in all, for the broker to hold it to as well.
        let sid = sub.sid;
        let limits: Vec<(u64, u64)> = frames
            .iter()
            .filter_map(|frame| match frame {
                Frame::UnsubscribeAfter { sid, total } => Some((*sid, *total)),
                _ => None,
            })
            .collect();
        assert_eq!(limits, [(sid, u64::MAX), (sid, 2)], "{frames:?}");
        // Not a queue member: the broker counts from the UNSUB what it
        // still takes.
        let (frames, _, _) = feed(&mut s, b"SUB b beta\r\n");
        let Frame::Subscribe(plain) = &frames[0] else {
            panic!("{frames:?}")
        };
        let plain = plain.sid;
        let (_, _, _) = deliver(&mut s, &message(plain, "b", None, b"x"));
        let (frames, _, _) = feed(&mut s, b"UNSUB beta 3\r\n");
        assert!(
            matches!(frames[..], [Frame::UnsubscribeAfter { sid, total: 2 }] if sid == plain),
            "{frames:?}"
        );
        // A second maximum counts from where the first began: one more
        // written since, a maximum of 4 is 3 for the broker, not 2.
        let (_, _, _) = deliver(&mut s, &message(plain, "b", None, b"y"));
        let (frames, _, _) = feed(&mut s, b"UNSUB beta 4\r\n");
        assert!(
            matches!(frames[..], [Frame::UnsubscribeAfter { sid, total: 3 }] if sid == plain),
            "{frames:?}"
        );
        let (out, back, _) = deliver(&mut s, &message(sid, "a.x", None, b"one"));
        assert_eq!(out, "MSG a.x alpha r.1 3\r\none\r\n");
        assert!(back.is_empty());
        let (out, back, _) = deliver(
            &mut s,
            &message(sid, "a.y", Some(b"NATS/1.0\r\n\r\n"), b"two"),
        );
        assert_eq!(out, "HMSG a.y alpha r.1 12 15\r\nNATS/1.0\r\n\r\ntwo\r\n");
        assert!(matches!(back[..], [Frame::Unsubscribe { sid: gone }] if gone == sid));
        let (out, _, _) = deliver(&mut s, &message(sid, "a.z", None, b"three"));
        assert_eq!(out, "", "past the maximum");
        assert_eq!(s.subscriptions(), 1, "`beta` is left");
    }

    /// Pings waiting in the output behind what a slow client has not read
    /// yet are not held against it; once it has everything, they are.
    #[test]
    fn pings_behind_unread_output_do_not_make_a_client_stale() {
        let mut s = session();
        assert_eq!(feed(&mut s, b"CONNECT {}\r\n").2, Ok(()));
        let mut unread = BytesMut::from(&b"MSG a 1 1\r\nx\r\n"[..]);
        for nonce in 1..=5 {
            let ping = codec::encode(&Frame::Ping { nonce }).to_bytes();
            assert_eq!(s.deliver(&ping, &mut unread, &mut Vec::new()), Ok(()));
        }
        let (out, _, result) = deliver(&mut s, &Frame::Ping { nonce: 6 });
        assert_eq!(out, "-ERR 'Stale Connection'\r\n");
        assert!(result.is_err());
    }

    /// A refusal that comes later than its SUB's verdict (the broker
    /// made the SUB wait for an inbox and refused it when it took it up)
    /// forgets that SUB, not the one whose verdict is due.
    #[test]
    fn a_late_refusal_forgets_the_sub_it_names() {
        let mut s = session();
        let (frames, _, _) = feed(&mut s, b"CONNECT {}\r\nSUB _INBOX.r.> 1\r\nSUB b 2\r\n");
        let pings = pings_in(&frames);
        for nonce in pings {
            assert_eq!(deliver(&mut s, &Frame::Pong { nonce }).2, Ok(()));
        }
        let (frames, _, _) = feed(&mut s, b"SUB c 3\r\n");
        assert!(matches!(
            frames[..],
            [Frame::Subscribe(_), Frame::Ping { .. }]
        ));
        let late = Frame::Error(ErrorFrame {
            code: ErrorCode::PermissionDenied,
            text: "permission denied: subscribe to \"_INBOX.r.>\" (the inbox is another \
                   connection's, user \"u\")"
                .into(),
            fatal: false,
        });
        assert_eq!(deliver(&mut s, &late).2, Ok(()));
        assert_eq!(s.subscriptions(), 2);
        let (frames, _, _) = feed(&mut s, b"UNSUB 1\r\n");
        assert!(frames.is_empty(), "the inbox SUB is forgotten: {frames:?}");
        let (frames, _, _) = feed(&mut s, b"UNSUB 3\r\n");
        assert!(
            matches!(frames[..], [Frame::Unsubscribe { .. }]),
            "`c` is held: {frames:?}"
        );
    }

    /// A refusal names its pattern as the broker writes it (escaped), and a
    /// late one is no operation's verdict: the `+OK` due is still given.
    #[test]
    fn refusals_are_matched_to_escaped_patterns_and_late_ones_to_no_verdict() {
        let mut s = session();
        let (frames, _, _) = feed(&mut s, b"CONNECT {\"verbose\":true}\r\nSUB a\"b 1\r\n");
        let pings = pings_in(&frames);
        let denied = |pattern: &str| {
            Frame::Error(ErrorFrame {
                code: ErrorCode::PermissionDenied,
                text: format!("permission denied: subscribe to {pattern:?} (deny, user \"u\")"),
                fatal: false,
            })
        };
        assert_eq!(deliver(&mut s, &denied("a\"b")).2, Ok(()));
        let (out, _, _) = deliver(&mut s, &Frame::Pong { nonce: pings[0] });
        assert_eq!(
            (out.as_str(), s.subscriptions()),
            ("", 0),
            "refused, forgotten"
        );
        // Accepted, then refused late while a publish's verdict is due.
        let (frames, _, _) = feed(&mut s, b"SUB c 2\r\n");
        let (out, _, _) = deliver(
            &mut s,
            &Frame::Pong {
                nonce: pings_in(&frames)[0],
            },
        );
        assert_eq!(out, "+OK\r\n");
        let (frames, _, _) = feed(&mut s, b"PUB d 1\r\nx\r\n");
        let publish_verdict = pings_in(&frames)[0];
        assert_eq!(deliver(&mut s, &denied("c")).2, Ok(()));
        assert_eq!(s.subscriptions(), 0, "`c` forgotten");
        let (out, _, _) = deliver(
            &mut s,
            &Frame::Pong {
                nonce: publish_verdict,
            },
        );
        assert_eq!(out, "+OK\r\n", "the publish was not refused");
    }

    /// A SUB the broker refuses holds nothing here either: it does not
    /// count towards the limit, so a client may subscribe again.
    #[test]
    fn a_refused_subscription_is_forgotten() {
        let mut s = session();
        let (frames, _, _) = feed(
            &mut s,
            b"CONNECT {}\r\nSUB orders.secret 1\r\nSUB ok 2\r\nSUB a..b 3\r\nPUB ok 1\r\nx\r\nSUB many 4\r\nSUB twice 5\r\nSUB twice 6\r\n",
        );
        // Each SUB is followed by the ping that brings its verdict.
        let pings = pings_in(&frames);
        assert_eq!(pings.len(), 6, "{frames:?}");
        assert_eq!(s.subscriptions(), 6);
        let error = |code, text: &str| {
            Frame::Error(ErrorFrame {
                code,
                text: text.into(),
                fatal: false,
            })
        };
        let denied = |subject: &str| {
            let text = format!("permission denied: subscribe to \"{subject}\" (deny, user \"u\")");
            error(ErrorCode::PermissionDenied, &text)
        };
        // The broker's answers in its order: an error before a SUB's ping
        // comes back refuses that SUB. The same pattern twice (5 refused, 6
        // not) is told apart, and a publish refused in between names no
        // subscription.
        let answers = [
            denied("orders.secret"),
            Frame::Pong { nonce: pings[0] },
            Frame::Pong { nonce: pings[1] },
            error(
                ErrorCode::InvalidSubject,
                "invalid pattern \"a..b\": empty token",
            ),
            Frame::Pong { nonce: pings[2] },
            error(
                ErrorCode::PermissionDenied,
                "permission denied: publish to \"ok\" (deny, user \"u\")",
            ),
            error(
                ErrorCode::TooManySubscriptions,
                "subscription limit of 4 reached; many refused",
            ),
            Frame::Pong { nonce: pings[3] },
            denied("twice"),
            Frame::Pong { nonce: pings[4] },
            Frame::Pong { nonce: pings[5] },
        ];
        let mut out = String::new();
        for answer in answers {
            let (text, _, result) = deliver(&mut s, &answer);
            assert_eq!(result, Ok(()));
            out.push_str(&text);
        }
        assert_eq!(s.subscriptions(), 2, "`ok` and the second `twice` are held");
        assert_eq!(out.matches("-ERR").count(), 5, "{out}");
        assert!(!out.contains("+OK") && !out.contains("PONG"), "{out}");
        // The sid refused first is free, the one taken again kept.
        let (frames, _, _) = feed(&mut s, b"UNSUB 6\r\nUNSUB 5\r\n");
        assert!(
            matches!(frames[..], [Frame::Unsubscribe { .. }]),
            "{frames:?}"
        );
        assert_eq!(s.subscriptions(), 1);
    }

    #[test]
    fn each_message_line_names_its_own_subject_and_subscription() {
        let mut s = session();
        let (frames, _, _) = feed(
            &mut s,
            b"CONNECT {\"headers\":true}\r\nSUB a.* one\r\nSUB > two\r\n",
        );
        let [_, Frame::Subscribe(one), Frame::Ping { .. }, Frame::Subscribe(two), Frame::Ping { .. }] =
            &frames[..]
        else {
            panic!("{frames:?}")
        };
        let (one, two) = (one.sid, two.sid);
        let block: &'static [u8] = b"NATS/1.0\r\n\r\n";
        let mut lines = String::new();
        for (sid, subject, headers) in [
            (one, "a.x", None),
            (one, "a.x", None),
            (two, "a.x", None),
            (two, "a.x", Some(block)),
            (one, "a.y", None),
            (one, "a.x", None),
        ] {
            let (out, _, _) = deliver(&mut s, &message(sid, subject, headers, b"p"));
            lines += out.lines().next().unwrap_or_default();
            lines += "|";
        }
        assert_eq!(
            lines,
            "MSG a.x one r.1 1|MSG a.x one r.1 1|MSG a.x two r.1 1|HMSG a.x two r.1 12 13|\
             MSG a.y one r.1 1|MSG a.x one r.1 1|"
        );
    }

    #[test]
    fn a_client_without_headers_gets_the_body_alone() {
        let mut s = session();
        let (frames, _, _) = feed(&mut s, b"CONNECT {}\r\nSUB a 1\r\n");
        let Frame::Subscribe(sub) = &frames[1] else {
            panic!("{frames:?}")
        };
        let (out, _, _) = deliver(
            &mut s,
            &message(sub.sid, "a", Some(b"NATS/1.0\r\n\r\n"), b"x"),
        );
        assert_eq!(out, "MSG a 1 r.1 1\r\nx\r\n");
    }

    #[test]
    fn verbose_answers_each_operation_after_the_broker_s_verdict() {
        let mut s = session();
        let (_, out, _) = feed(&mut s, b"CONNECT {\"verbose\":true}\r\n");
        assert_eq!(out, "+OK\r\n");
        let (frames, out, _) = feed(&mut s, b"PUB a.secret 1\r\nx\r\nPING\r\nSUB b 1\r\n");
        assert_eq!(out, "", "no +OK before the broker's verdict");
        let [Frame::Publish(_), Frame::Ping { nonce: publish }, Frame::Ping { nonce: ping }, Frame::Subscribe(_), Frame::Ping { nonce: subscribe }] =
            frames[..]
        else {
            panic!("{frames:?}")
        };
        let denied = Frame::Error(ErrorFrame {
            code: ErrorCode::PermissionDenied,
            text: "permission denied: publish to \"a.secret\" (deny)".into(),
            fatal: false,
        });
        // The refused publish gets its error instead of +OK; the client's
        // PING its PONG; the subscription its +OK.
        let mut answers = String::new();
        for frame in [
            denied,
            Frame::Pong { nonce: publish },
            Frame::Pong { nonce: ping },
            Frame::Pong { nonce: subscribe },
        ] {
            answers += &deliver(&mut s, &frame).0;
        }
        assert_eq!(
            answers,
            "-ERR 'Permissions Violation for Publish to \"a.secret\"'\r\nPONG\r\n+OK\r\n"
        );
        // Without verbose nothing is asked of the broker.
        let mut quiet = session();
        assert_eq!(feed(&mut quiet, b"CONNECT {}\r\n").2, Ok(()));
        let (frames, out, _) = feed(&mut quiet, b"PUB a 1\r\nx\r\n");
        assert!(matches!(frames[..], [Frame::Publish(_)]), "{frames:?}");
        assert_eq!(out, "");
    }

    /// Pings sent while the broker does not read the client (held back
    /// under `block`) find their answers unread: not counted against it,
    /// neither then nor once reading resumes, until answered.
    #[test]
    fn pings_sent_while_reads_are_held_do_not_make_a_client_stale() {
        let mut s = session();
        assert_eq!(feed(&mut s, b"CONNECT {}\r\n").2, Ok(()));
        s.set_reads_held(true);
        for nonce in 1..=10 {
            let (out, _, result) = deliver(&mut s, &Frame::Ping { nonce });
            assert_eq!((out.as_str(), result), ("PING\r\n", Ok(())), "ping {nonce}");
        }
        s.set_reads_held(false);
        // Read again: one more unanswered is not yet two.
        assert_eq!(deliver(&mut s, &Frame::Ping { nonce: 11 }).2, Ok(()));
        assert_eq!(deliver(&mut s, &Frame::Ping { nonce: 12 }).2, Ok(()));
        // The answers come in order: the oldest ping's first.
        let (frames, _, _) = feed(&mut s, b"PONG\r\n");
        assert!(
            matches!(frames[..], [Frame::Pong { nonce: 1 }]),
            "{frames:?}"
        );
        // A client that answers nothing after reads resume is still stale.
        let (out, _, result) = deliver(&mut s, &Frame::Ping { nonce: 13 });
        assert_eq!(out, "-ERR 'Stale Connection'\r\n");
        assert!(result.is_err());
    }

    #[test]
    fn broker_pings_need_answers_and_errors_use_nats_texts() {
        let mut s = session();
        assert_eq!(feed(&mut s, b"CONNECT {}\r\n").2, Ok(()));
        assert_eq!(deliver(&mut s, &Frame::Ping { nonce: 7 }).0, "PING\r\n");
        let (frames, _, _) = feed(&mut s, b"PONG\r\n");
        assert!(matches!(frames[..], [Frame::Pong { nonce: 7 }]));
        assert_eq!(deliver(&mut s, &Frame::Ping { nonce: 8 }).2, Ok(()));
        assert_eq!(deliver(&mut s, &Frame::Ping { nonce: 9 }).2, Ok(()));
        let (out, _, result) = deliver(&mut s, &Frame::Ping { nonce: 10 });
        assert_eq!(out, "-ERR 'Stale Connection'\r\n");
        assert!(result.is_err());

        let denied = Frame::Error(ErrorFrame {
            code: ErrorCode::PermissionDenied,
            text: "permission denied: subscribe to \"orders.secret\" (deny, user \"u\")".into(),
            fatal: false,
        });
        let (out, _, result) = deliver(&mut s, &denied);
        assert_eq!(
            out,
            "-ERR 'Permissions Violation for Subscription to \"orders.secret\"'\r\n"
        );
        assert_eq!(result, Ok(()), "not fatal");
        let auth = Frame::Error(ErrorFrame {
            code: ErrorCode::Auth,
            text: "wrong password".into(),
            fatal: true,
        });
        assert_eq!(
            deliver(&mut s, &auth).0,
            "-ERR 'Authorization Violation'\r\n"
        );
        let bye = Frame::Goodbye(Goodbye { reason: "x".into() });
        assert!(deliver(&mut s, &bye).2.is_err());
    }

    #[test]
    fn malformed_input_ends_with_an_error_never_a_panic() {
        let cases: [(&[u8], &str); 9] = [
            (b"FOO bar\r\n", "Unknown Protocol Operation"),
            (b"CONNECT {nope\r\n", "Parser Error"),
            (b"CONNECT {}\r\nPUB a\r\n", "Parser Error"),
            (b"CONNECT {}\r\nPUB a -1\r\n", "Parser Error"),
            (b"CONNECT {}\r\nPUB a 99999999999999\r\n", "Parser Error"),
            (b"CONNECT {}\r\nPUB a 2048\r\n", "Maximum Payload Violation"),
            (b"CONNECT {}\r\nPUB a 1\r\nxy\r\n", "Parser Error"),
            (b"CONNECT {}\r\nHPUB a 5 3\r\n", "Parser Error"),
            (b"CONNECT {}\r\nHPUB a 3 3\r\nabc\r\n", "Parser Error"),
        ];
        for (input, error) in cases {
            let mut s = session();
            let (_, out, result) = feed(&mut s, input);
            assert_eq!(
                result,
                Err(fatal(error)),
                "{}",
                String::from_utf8_lossy(input)
            );
            assert!(out.ends_with(&format!("-ERR '{error}'\r\n")), "{out}");
        }
        let mut s = session();
        let long = vec![b'x'; MAX_CONNECT_LINE + 1];
        assert_eq!(
            feed(&mut s, &long).2,
            Err(fatal("Maximum Control Line Exceeded"))
        );
        let mut s = session();
        assert_eq!(feed(&mut s, b"CONNECT {}\r\n").2, Ok(()));
        let long = [b"SUB ".as_slice(), &[b'a'; 5000]].concat();
        assert_eq!(
            feed(&mut s, &long).2,
            Err(fatal("Maximum Control Line Exceeded"))
        );
    }

    #[test]
    fn operations_before_connect_need_it_only_when_auth_is_required() {
        let mut open = session();
        let (frames, out, result) = feed(&mut open, b"PING\r\nSUB a 1\r\n");
        assert_eq!((out.as_str(), result), ("PONG\r\n", Ok(())));
        assert!(matches!(
            frames[..],
            [Frame::Hello(_), Frame::Subscribe(_), Frame::Ping { .. }]
        ));
        let mut closed = NatsSession::new(ServerInfo {
            auth_required: true,
            ..ServerInfo::default()
        });
        let (frames, out, _) = feed(&mut closed, b"PUB a 1\r\nx\r\n");
        assert!(frames.is_empty());
        assert_eq!(out, "-ERR 'Authorization Violation'\r\n");
    }

    #[test]
    fn nothing_after_connect_runs_ahead_of_the_verdict() {
        let mut s = NatsSession::new(ServerInfo {
            auth_required: true,
            max_subscriptions: 2,
            ..ServerInfo::default()
        });
        let (_, out, result) = feed_as(&mut s, b"PING\r\n", false);
        assert_eq!(
            out, "-ERR 'Authorization Violation'\r\n",
            "no PONG before logging in"
        );
        assert!(result.is_err());

        let mut s = NatsSession::new(ServerInfo {
            auth_required: true,
            max_subscriptions: 2,
            ..ServerInfo::default()
        });
        let text = b"CONNECT {\"auth_token\":\"t\"}\r\nPUB a 1\r\nx\r\n";
        let (frames, _, _) = feed_as(&mut s, text, false);
        assert!(matches!(frames[..], [Frame::Hello(_)]), "{frames:?}");
        assert!(s.holding());
        // Once welcomed, operations run, and subscriptions whose verdicts
        // have not come are bounded.
        let room = 2 + MAX_SUBS_AWAITING_VERDICT;
        let subs: String = (0..=room)
            .map(|sid| format!("SUB s{sid} {sid}\r\n"))
            .collect();
        let (frames, out, result) = feed(&mut s, subs.as_bytes());
        assert_eq!(result, Ok(()));
        let subscribes = frames.iter().filter(|f| matches!(f, Frame::Subscribe(_)));
        assert_eq!(subscribes.count(), room, "the last one is refused here");
        assert_eq!(out, "-ERR 'Maximum Subscriptions Exceeded'\r\n");
        let long = format!("SUB d {}\r\n", "9".repeat(MAX_SID_LEN + 1));
        assert_eq!(feed(&mut s, long.as_bytes()).2, Err(fatal("Parser Error")));
    }

    #[test]
    fn info_names_the_server_and_its_limits() {
        let info = ServerInfo {
            server_id: "id".into(),
            server_name: "n".into(),
            auth_required: true,
            ..ServerInfo::default()
        };
        let line = info.info_line(3, "127.0.0.1", 4222, "127.0.0.1");
        let json: serde_json::Value =
            serde_json::from_str(line.strip_prefix("INFO ").expect("INFO").trim()).expect("json");
        assert_eq!(json["server_name"], "n");
        assert_eq!(json["max_payload"], codec::DEFAULT_MAX_PAYLOAD);
        assert_eq!(json["auth_required"], true);
        assert_eq!(json["headers"], true);
        assert_eq!(json["proto"], 1);
    }
}
