//! Routing benchmarks: subject lookup in the subscription index.
//!
//! Subscriptions model a metrics fan-in: subjects `metrics.host{H}.cpu{C}`,
//! patterns mixing literals, `*` and `>`, some in queue groups. Two mixes:
//! `literal` (95 % literal patterns) and `wildcard` (50 %), each at 10k, 100k
//! and 1M subscriptions. Cases:
//!
//! - `hit`: a hot set of 1024 subjects that stays in the cache;
//! - `miss`: a cycle of 65536 distinct subjects through the default 4096-entry
//!   cache, so almost every lookup walks the trie and refills the cache;
//! - `walk`: the trie alone (`match_uncached`), random subjects.
//!
//! A `churn` group measures one insert plus one remove on a warm cache, for a
//! literal pattern (one cache entry dropped) and a wildcard pattern (cache
//! scanned), at 100k subscriptions.
//!
//! Run as a test (`cargo test --all-targets`), every case uses 10k
//! subscriptions only: building the large indexes unoptimised takes tens of
//! seconds and proves nothing the small one does not.

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use efabus::core::index::{SubRef, SubscriptionIndex};

mod support;

const CPUS: u64 = 100;
const HOT: usize = 1024;
const COLD: usize = 65536;
const WALK: usize = 4096;
/// Index sizes of the `match` group.
const SIZES: [usize; 3] = [10_000, 100_000, 1_000_000];
/// Index size of the `churn` group.
const CHURN_SIZE: usize = 100_000;

/// The index sizes to run: all of them, or only the smallest in a test run.
fn sizes() -> &'static [usize] {
    if support::test_mode() {
        &SIZES[..1]
    } else {
        &SIZES
    }
}

/// splitmix64: a small deterministic generator, so runs are comparable.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Clone, Copy)]
enum Mix {
    Literal,
    Wildcard,
}

impl Mix {
    fn name(self) -> &'static str {
        match self {
            Mix::Literal => "literal",
            Mix::Wildcard => "wildcard",
        }
    }

    /// Share of wildcard patterns, in percent.
    fn wildcard_pct(self) -> u64 {
        match self {
            Mix::Literal => 5,
            Mix::Wildcard => 50,
        }
    }
}

/// One subscription. Wildcard patterns are spread over hosts, so the
/// fan-out of a subject stays about the same at every size.
fn pattern(rng: &mut Rng, mix: Mix, hosts: u64) -> (String, Option<&'static str>) {
    let h = rng.below(hosts);
    let c = rng.below(CPUS);
    if rng.below(100) >= mix.wildcard_pct() {
        return (format!("metrics.host{h}.cpu{c}"), None);
    }
    match rng.below(100) {
        0..=39 => (format!("metrics.host{h}.*"), None),
        40..=59 => (format!("metrics.host{h}.*"), Some("workers")),
        60..=84 => (format!("metrics.host{h}.>"), None),
        _ => (format!("*.host{h}.cpu{c}"), Some("audit")),
    }
}

/// Broad subscriptions (per-cpu dashboards, full taps), a fixed number at
/// every size.
const BROAD: [(&str, u64); 2] = [("metrics.*.cpu{}", 200), ("metrics.>", 4)];

fn build(total: usize, mix: Mix) -> (SubscriptionIndex, u64) {
    let hosts = (total as u64 / CPUS).max(1);
    let mut rng = Rng(total as u64 ^ mix.wildcard_pct());
    let mut idx = SubscriptionIndex::default();
    let started = Instant::now();
    let broad: u64 = BROAD.iter().map(|&(_, n)| n).sum();
    for i in 0..total as u64 - broad {
        let (p, q) = pattern(&mut rng, mix, hosts);
        idx.insert(&p, q, SubRef::new(i % 256, i))
            .expect("valid pattern");
    }
    let mut sid = total as u64;
    for (template, n) in BROAD {
        for _ in 0..n {
            let p = template.replace("{}", &rng.below(CPUS).to_string());
            idx.insert(&p, None, SubRef::new(sid % 256, sid))
                .expect("valid pattern");
            sid += 1;
        }
    }
    eprintln!(
        "built {} {} subscriptions, {} trie nodes, in {:.2?}",
        idx.len(),
        mix.name(),
        idx.node_count(),
        started.elapsed()
    );
    (idx, hosts)
}

fn subjects(rng: &mut Rng, n: usize, hosts: u64) -> Vec<String> {
    (0..n)
        .map(|_| format!("metrics.host{}.cpu{}", rng.below(hosts), rng.below(CPUS)))
        .collect()
}

/// `n` distinct subjects; hosts beyond the subscribed range fill up small spaces.
fn distinct_subjects(rng: &mut Rng, n: usize, hosts: u64) -> Vec<String> {
    let space_hosts = hosts.max((n as u64).div_ceil(CPUS));
    let mut all: Vec<(u64, u64)> = (0..space_hosts)
        .flat_map(|h| (0..CPUS).map(move |c| (h, c)))
        .collect();
    // Fisher-Yates, then keep n.
    for i in (1..all.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        all.swap(i, j);
    }
    all.truncate(n);
    all.into_iter()
        .map(|(h, c)| format!("metrics.host{h}.cpu{c}"))
        .collect()
}

fn bench_match(c: &mut Criterion) {
    let mut group = c.benchmark_group("match");
    for mix in [Mix::Literal, Mix::Wildcard] {
        for &total in sizes() {
            let (idx, hosts) = build(total, mix);
            let mut rng = Rng(7);
            let hot = distinct_subjects(&mut rng, HOT, hosts);
            let cold = distinct_subjects(&mut rng, COLD, hosts);
            let walk = subjects(&mut rng, WALK, hosts);
            let mut out = Vec::with_capacity(256);
            let mut fanout = 0;
            for s in &hot {
                idx.match_subject(s, &mut out).expect("valid subject");
                fanout += out.len();
            }
            eprintln!("mean fan-out {:.1}", fanout as f64 / HOT as f64);

            let mut i = 0usize;
            group.bench_function(
                BenchmarkId::new(format!("{}/hit", mix.name()), total),
                |b| {
                    b.iter(|| {
                        let s = &hot[i % HOT];
                        i += 1;
                        idx.match_subject(black_box(s), &mut out).expect("valid");
                        black_box(out.len())
                    })
                },
            );
            group.bench_function(
                BenchmarkId::new(format!("{}/miss", mix.name()), total),
                |b| {
                    b.iter(|| {
                        let s = &cold[i % COLD];
                        i += 1;
                        idx.match_subject(black_box(s), &mut out).expect("valid");
                        black_box(out.len())
                    })
                },
            );
            group.bench_function(
                BenchmarkId::new(format!("{}/walk", mix.name()), total),
                |b| {
                    b.iter(|| {
                        let s = &walk[i % WALK];
                        i += 1;
                        idx.match_uncached(black_box(s), &mut out).expect("valid");
                        black_box(out.len())
                    })
                },
            );
        }
    }
    group.finish();
}

fn bench_churn(c: &mut Criterion) {
    let mut group = c.benchmark_group("churn");
    let total = if support::test_mode() {
        SIZES[0]
    } else {
        CHURN_SIZE
    };
    let (mut idx, hosts) = build(total, Mix::Literal);
    let mut rng = Rng(11);
    let mut out = Vec::new();
    // Fill the cache so invalidation has work to do.
    for s in distinct_subjects(&mut rng, 4096, hosts) {
        idx.match_subject(&s, &mut out).expect("valid subject");
    }
    let key = SubRef::new(u64::MAX, 0);
    for (name, pattern) in [
        ("literal", "metrics.host1.cpu1"),
        ("wildcard", "metrics.*.cpu1"),
    ] {
        group.bench_function(BenchmarkId::new(name, total), |b| {
            b.iter(|| {
                idx.insert(black_box(pattern), None, key).expect("valid");
                black_box(idx.remove(key))
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_match, bench_churn);
criterion_main!(benches);
