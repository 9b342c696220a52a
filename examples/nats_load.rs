//! A load generator for nats-server, the reference `scripts/bench-compare`
//! measures efabus against. It speaks the NATS text protocol over plain TCP
//! with the same shapes and figures as `efabus bench`, so both sides are
//! driven by compiled, batched client loops:
//!
//! - throughput: P publishers (one connection and thread each) write N
//!   messages of B bytes through a 64 KiB buffered writer; S subscribers
//!   (one connection and thread each) count deliveries. The figure is
//!   messages delivered per second, from the first publish to the last
//!   delivery.
//! - latency: one responder echoes requests to their reply subject; one
//!   requester sends a request, waits for the reply on a shared inbox
//!   (`_INBOX.<id>.*`, as current NATS clients do), and records the round
//!   trip.
//!
//! Output is one JSON object on stdout, with the field names of
//! `efabus bench --json`.
//!
//! ```text
//! nats-server -a 127.0.0.1 -p 4222 &
//! cargo run --release --example nats_load -- throughput --server 127.0.0.1:4222 -S 4 --size 16 -n 1000000
//! cargo run --release --example nats_load -- latency --server 127.0.0.1:4222 -n 20000
//! ```

use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::net::TcpStream;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(about = "NATS protocol load generator (the reference side of scripts/bench-compare)")]
struct Cli {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Debug, Subcommand)]
enum Mode {
    /// Delivered messages per second with P publishers and S subscribers.
    Throughput {
        /// nats-server address (HOST:PORT).
        #[arg(long, short, default_value = "127.0.0.1:4222")]
        server: String,
        /// Publishers.
        #[arg(long, short, default_value_t = 1)]
        pubs: usize,
        /// Subscribers.
        #[arg(long = "subs", short = 'S', default_value_t = 1)]
        subs: usize,
        /// Payload size in bytes.
        #[arg(long, default_value_t = 16)]
        size: usize,
        /// Messages per publisher.
        #[arg(long, short = 'n', default_value_t = 1_000_000)]
        count: u64,
    },
    /// Request/reply round trips and their percentiles.
    Latency {
        /// nats-server address (HOST:PORT).
        #[arg(long, short, default_value = "127.0.0.1:4222")]
        server: String,
        /// Payload size in bytes.
        #[arg(long, default_value_t = 16)]
        size: usize,
        /// Round trips.
        #[arg(long, short = 'n', default_value_t = 20_000)]
        count: u64,
    },
}

/// One NATS connection: a buffered reader and writer over the same socket.
struct Connection {
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
    line: Vec<u8>,
}

/// A message as read from the wire: only what the load loops need.
struct Delivery {
    reply: Option<Vec<u8>>,
    payload: Vec<u8>,
}

fn protocol_error(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

impl Connection {
    /// Connect, read INFO, send CONNECT, and round-trip a PING so the
    /// server has accepted the connection before any load starts.
    fn open(server: &str, name: &str) -> io::Result<Connection> {
        let stream = TcpStream::connect(server)?;
        stream.set_nodelay(true)?;
        let mut conn = Connection {
            reader: BufReader::with_capacity(1 << 20, stream.try_clone()?),
            writer: BufWriter::with_capacity(64 << 10, stream),
            line: Vec::with_capacity(256),
        };
        conn.read_line()?;
        if !conn.line.starts_with(b"INFO") {
            return Err(protocol_error("expected INFO from the server"));
        }
        write!(
            conn.writer,
            "CONNECT {{\"verbose\":false,\"pedantic\":false,\"tls_required\":false,\"name\":\"{name}\",\"lang\":\"rust\",\"version\":\"0.1.0\",\"protocol\":1,\"echo\":true}}\r\n"
        )?;
        conn.sync()?;
        Ok(conn)
    }

    fn read_line(&mut self) -> io::Result<()> {
        self.line.clear();
        let n = self.reader.read_until(b'\n', &mut self.line)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "server closed the connection",
            ));
        }
        Ok(())
    }

    /// PING and wait for the PONG: everything written before was processed.
    fn sync(&mut self) -> io::Result<()> {
        self.writer.write_all(b"PING\r\n")?;
        self.writer.flush()?;
        match self.next()? {
            None => Ok(()),
            Some(_) => Err(protocol_error("unexpected MSG while syncing")),
        }
    }

    fn subscribe(&mut self, subject: &str, sid: u64) -> io::Result<()> {
        write!(self.writer, "SUB {subject} {sid}\r\n")
    }

    fn publish(&mut self, subject: &str, reply: Option<&[u8]>, payload: &[u8]) -> io::Result<()> {
        self.writer.write_all(b"PUB ")?;
        self.writer.write_all(subject.as_bytes())?;
        if let Some(reply) = reply {
            self.writer.write_all(b" ")?;
            self.writer.write_all(reply)?;
        }
        write!(self.writer, " {}\r\n", payload.len())?;
        self.writer.write_all(payload)?;
        self.writer.write_all(b"\r\n")
    }

    /// The next message; `None` for a PONG. Answers server PINGs itself.
    fn next(&mut self) -> io::Result<Option<Delivery>> {
        loop {
            self.read_line()?;
            let line = trim_crlf(&self.line);
            if line.starts_with(b"MSG ") {
                return self.message().map(Some);
            } else if line == b"PONG" {
                return Ok(None);
            } else if line == b"PING" {
                self.writer.write_all(b"PONG\r\n")?;
                self.writer.flush()?;
            } else if line.starts_with(b"-ERR") {
                return Err(protocol_error(String::from_utf8_lossy(line).into_owned()));
            }
            // +OK and INFO updates need no answer.
        }
    }

    /// Parse `MSG <subject> <sid> [reply] <bytes>` in `self.line`, then read
    /// the payload and its CRLF.
    fn message(&mut self) -> io::Result<Delivery> {
        let line = trim_crlf(&self.line);
        let fields: Vec<&[u8]> = line.split(|b| *b == b' ').collect();
        let (reply, size) = match fields.as_slice() {
            [_, _, _, size] => (None, *size),
            [_, _, _, reply, size] => (Some(reply.to_vec()), *size),
            _ => return Err(protocol_error("malformed MSG line")),
        };
        let size: usize = std::str::from_utf8(size)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| protocol_error("bad MSG size"))?;
        let mut payload = vec![0u8; size + 2];
        self.reader.read_exact(&mut payload)?;
        payload.truncate(size);
        Ok(Delivery { reply, payload })
    }

    /// Count MSGs until `want` arrived, without keeping payloads. The
    /// shared count is added to every 4096 messages and at the end, as the
    /// efabus bench's readers do (a counter shared by every reader and
    /// bumped per message costs more than parsing the message).
    fn drain(&mut self, want: u64, delivered: &AtomicU64) -> io::Result<()> {
        let mut got = 0u64;
        let mut unshared = 0u64;
        let mut skip = Vec::new();
        let result = self.drain_counting(want, &mut got, &mut unshared, delivered, &mut skip);
        delivered.fetch_add(unshared, Ordering::Relaxed);
        result
    }

    fn drain_counting(
        &mut self,
        want: u64,
        got: &mut u64,
        unshared: &mut u64,
        delivered: &AtomicU64,
        skip: &mut Vec<u8>,
    ) -> io::Result<()> {
        while *got < want {
            self.read_line()?;
            let line = trim_crlf(&self.line);
            if line.starts_with(b"MSG ") {
                let size = line
                    .rsplit(|b| *b == b' ')
                    .next()
                    .and_then(|s| std::str::from_utf8(s).ok())
                    .and_then(|s| s.parse::<usize>().ok())
                    .ok_or_else(|| protocol_error("bad MSG size"))?;
                skip.resize(size + 2, 0);
                self.reader.read_exact(skip)?;
                *got += 1;
                *unshared += 1;
                if *unshared == 4096 {
                    delivered.fetch_add(4096, Ordering::Relaxed);
                    *unshared = 0;
                }
            } else if line == b"PING" {
                self.writer.write_all(b"PONG\r\n")?;
                self.writer.flush()?;
            } else if line.starts_with(b"-ERR") {
                return Err(protocol_error(String::from_utf8_lossy(line).into_owned()));
            }
        }
        Ok(())
    }
}

fn trim_crlf(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

fn throughput(server: &str, pubs: usize, subs: usize, size: usize, count: u64) -> io::Result<()> {
    let subject = format!("bench.{}", std::process::id());
    let expected = pubs as u64 * count * subs as u64;
    let delivered = Arc::new(AtomicU64::new(0));
    let mut readers = Vec::new();
    for i in 0..subs {
        let mut conn = Connection::open(server, &format!("nats-load-sub-{i}"))?;
        conn.subscribe(&subject, 1)?;
        conn.sync()?;
        readers.push(conn);
    }
    let mut writers = Vec::new();
    for i in 0..pubs {
        writers.push(Connection::open(server, &format!("nats-load-pub-{i}"))?);
    }
    let payload = vec![0x5a_u8; size];
    let started = Instant::now();
    let finished = std::thread::scope(|scope| -> io::Result<Instant> {
        let mut reader_threads = Vec::new();
        for mut conn in readers {
            let delivered = delivered.clone();
            reader_threads.push(scope.spawn(move || -> io::Result<Instant> {
                conn.drain(pubs as u64 * count, &delivered)?;
                Ok(Instant::now())
            }));
        }
        let mut writer_threads = Vec::new();
        for mut conn in writers {
            let subject = subject.as_str();
            let payload = payload.as_slice();
            writer_threads.push(scope.spawn(move || -> io::Result<()> {
                for _ in 0..count {
                    conn.publish(subject, None, payload)?;
                }
                conn.sync()
            }));
        }
        for writer in writer_threads {
            writer
                .join()
                .map_err(|_| io::Error::other("publisher thread panicked"))??;
        }
        let mut last = started;
        for reader in reader_threads {
            let done = reader
                .join()
                .map_err(|_| io::Error::other("subscriber thread panicked"))??;
            last = last.max(done);
        }
        Ok(last)
    })?;
    let seconds = finished.duration_since(started).as_secs_f64().max(1e-9);
    let delivered = delivered.load(Ordering::Relaxed);
    let published = pubs as u64 * count;
    println!(
        "{{\"mode\":\"throughput\",\"target\":\"nats {server}\",\"publishers\":{pubs},\"subscribers\":{subs},\"payload_bytes\":{size},\"published\":{published},\"delivered\":{delivered},\"expected\":{expected},\"seconds\":{seconds:.6},\"published_per_sec\":{:.1},\"delivered_per_sec\":{:.1},\"delivered_mb_per_sec\":{:.3}}}",
        published as f64 / seconds,
        delivered as f64 / seconds,
        delivered as f64 * size as f64 / seconds / 1e6
    );
    Ok(())
}

fn latency(server: &str, size: usize, count: u64) -> io::Result<()> {
    let subject = format!("bench.rpc.{}", std::process::id());
    let mut responder = Connection::open(server, "nats-load-responder")?;
    responder.subscribe(&subject, 1)?;
    responder.sync()?;
    let mut requester = Connection::open(server, "nats-load-requester")?;
    let inbox = format!("_INBOX.{}", std::process::id());
    requester.subscribe(&format!("{inbox}.*"), 1)?;
    requester.sync()?;
    let payload = vec![0x5a_u8; size];
    let mut nanos = Vec::with_capacity(count as usize);
    let started = Instant::now();
    std::thread::scope(|scope| -> io::Result<()> {
        let echo = scope.spawn(move || -> io::Result<()> {
            loop {
                let Some(request) = responder.next()? else {
                    continue;
                };
                // A request without reply subject is the signal to stop.
                let Some(reply) = request.reply else {
                    return Ok(());
                };
                let reply = String::from_utf8_lossy(&reply).into_owned();
                responder.publish(&reply, None, &request.payload)?;
                responder.writer.flush()?;
            }
        });
        let result = (|| -> io::Result<()> {
            let mut reply = Vec::with_capacity(64);
            for i in 0..count {
                reply.clear();
                write!(reply, "{inbox}.{i}")?;
                let sent = Instant::now();
                requester.publish(&subject, Some(&reply), &payload)?;
                requester.writer.flush()?;
                loop {
                    if requester.next()?.is_some() {
                        break;
                    }
                }
                nanos.push(sent.elapsed().as_nanos() as u64);
            }
            Ok(())
        })();
        // Stop the responder even when the requester failed.
        let stop = requester
            .publish(&subject, None, b"")
            .and_then(|()| requester.writer.flush());
        let echoed = echo
            .join()
            .map_err(|_| io::Error::other("responder thread panicked"))?;
        result.and(stop).and(echoed)
    })?;
    let seconds = started.elapsed().as_secs_f64();
    nanos.sort_unstable();
    let us = |q: f64| -> f64 {
        if nanos.is_empty() {
            return 0.0;
        }
        let index = ((q * nanos.len() as f64).ceil() as usize).clamp(1, nanos.len()) - 1;
        nanos[index] as f64 / 1000.0
    };
    println!(
        "{{\"mode\":\"latency\",\"target\":\"nats {server}\",\"payload_bytes\":{size},\"round_trips\":{},\"seconds\":{seconds:.6},\"p50_us\":{:.3},\"p90_us\":{:.3},\"p99_us\":{:.3},\"p999_us\":{:.3},\"max_us\":{:.3}}}",
        nanos.len(),
        us(0.5),
        us(0.9),
        us(0.99),
        us(0.999),
        us(1.0)
    );
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.mode {
        Mode::Throughput {
            server,
            pubs,
            subs,
            size,
            count,
        } => {
            if pubs == 0 || subs == 0 || count == 0 {
                eprintln!("nats_load: --pubs, --subs and --count must be at least 1");
                return ExitCode::from(2);
            }
            throughput(&server, pubs, subs, size, count)
        }
        Mode::Latency {
            server,
            size,
            count,
        } => latency(&server, size, count),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("nats_load: {err}");
            ExitCode::FAILURE
        }
    }
}
