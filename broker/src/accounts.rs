//! Users and their permissions (`[[auth.users]]`): who a client is, and
//! what it may publish and subscribe to.
//!
//! A user is a name with a password, or a token, each stored only as an
//! argon2id hash ([`hash_secret`], which `efabus passwd` prints). A client
//! logs in with the name and password in its hello, or with the token
//! alone. Checking a hash costs tens of milliseconds on purpose, so the
//! broker checks them on a login thread, not its event loop: what checked
//! once is remembered (by a keyed hash of the name and secret, never the
//! secret itself) and taken on the loop, and failures count towards the
//! address's lockout like any refused hello.
//!
//! Permissions: a publish is allowed when its subject is matched by an
//! `allow` pattern (or `allow` is empty) and by no `deny` pattern. A
//! subscription is allowed when an `allow` pattern covers its whole
//! pattern (or `allow` is empty) and no `deny` pattern could match a
//! subject it would receive, so a subscription never carries a denied
//! subject. Replies are allowed beside `allow` (never beside `deny`): a
//! user may publish to the reply subject of a message delivered to it (a
//! responder answering; the broker remembers the latest
//! [`REPLIES_REMEMBERED`] per connection), and subscribe under one literal
//! inbox, `_INBOX.<token>.`, that no other connection uses (a requester
//! waiting for answers: the first connection to subscribe under an inbox
//! holds it until it goes) and that is not the inbox of a request it was
//! given (a responder does not take over its requester's inbox while the
//! requester reconnects). The event loop keeps both ([`Replies`]).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use efabus_core::subject::{self, pattern_covers, pattern_matches, patterns_overlap};
use parking_lot::Mutex;

use crate::config::{Permissions, Rule, User};

/// Reply subjects remembered per restricted connection.
pub const REPLIES_REMEMBERED: usize = 1024;
/// Checked credentials remembered at most; the set starts over when full.
const VERIFIED_MAX: usize = 4096;

/// The subject common name of a certificate (DER), if it has one.
pub fn certificate_name(der: &[u8]) -> Option<String> {
    let (_, certificate) = x509_parser::parse_x509_certificate(der).ok()?;
    let name = certificate.subject().iter_common_name().next()?;
    name.as_str().ok().map(str::to_string)
}

/// Most memory (KiB), passes and lanes a user's hash may ask a check
/// of: each login not remembered runs one on the login thread. The
/// published recommendations are all within (RFC 9106's first, 2 GiB and
/// 1 pass; libsodium's strongest, 1 GiB and 4); a hash past them is a
/// mistake that would hold every other login up, or the broker's memory.
/// `efabus passwd` asks 19 MiB, 2 passes, 1 lane.
const MAX_HASH_MEMORY_KIB: u32 = 2 * 1024 * 1024;
const MAX_HASH_PASSES: u32 = 64;
const MAX_HASH_LANES: u32 = 64;

/// A user's `password` or `token` as configured: an Argon2 hash (PHC
/// string; `efabus passwd` makes argon2id ones, other tools argon2i or
/// argon2d) whose cost is within the bounds above.
fn check_hash(hash: &str) -> Result<(), String> {
    let not_ours = "is not an Argon2 hash: store what `efabus passwd` prints, never the \
                    secret itself";
    let parsed = PasswordHash::new(hash).map_err(|_| not_ours.to_string())?;
    if argon2::Algorithm::try_from(parsed.algorithm).is_err() {
        return Err(not_ours.to_string());
    }
    let params = argon2::Params::try_from(&parsed).map_err(|err| format!("{not_ours} ({err})"))?;
    let (memory, passes, lanes) = (params.m_cost(), params.t_cost(), params.p_cost());
    if memory > MAX_HASH_MEMORY_KIB || passes > MAX_HASH_PASSES || lanes > MAX_HASH_LANES {
        return Err(format!(
            "asks m={memory} KiB, t={passes}, p={lanes} of every check; at most \
             m={MAX_HASH_MEMORY_KIB}, t={MAX_HASH_PASSES}, p={MAX_HASH_LANES} (hash again \
             with `efabus passwd`)"
        ));
    }
    Ok(())
}

/// A new argon2id hash (PHC string) of `secret`, with a random salt.
pub fn hash_secret(secret: &str) -> Result<String, String> {
    let salt: [u8; 16] = crate::session::link_auth::random_bytes().map_err(|e| e.to_string())?;
    let salt = SaltString::encode_b64(&salt).map_err(|e| e.to_string())?;
    Argon2::default()
        .hash_password(secret.as_bytes(), &salt)
        .map(|hash| hash.to_string())
        .map_err(|e| e.to_string())
}

/// Checks `[[auth.users]]`: names unique and non-empty, a password or a
/// token (hashes, not the secrets themselves), valid patterns. The error
/// names the key.
pub(crate) fn check_users(users: &[User]) -> Result<(), (String, String)> {
    let mut names = HashSet::new();
    let mut certificates = HashSet::new();
    for (i, user) in users.iter().enumerate() {
        let key = |field: &str| format!("auth.users[{i}].{field}");
        if user.name.is_empty() {
            return Err((key("name"), "must not be empty".to_string()));
        }
        if !names.insert(user.name.as_str()) {
            return Err((key("name"), format!("{:?} is listed twice", user.name)));
        }
        if user.password.is_none() && user.token.is_none() && user.certificate.is_none() {
            return Err((
                key("password"),
                "a user needs a password or a token (hashes made with `efabus passwd`), or a \
                 client certificate's name"
                    .to_string(),
            ));
        }
        if let Some(certificate) = user.certificate.as_deref() {
            if certificate.is_empty() {
                return Err((key("certificate"), "must not be empty".to_string()));
            }
            if !certificates.insert(certificate) {
                return Err((
                    key("certificate"),
                    format!("{certificate:?} names two users"),
                ));
            }
        }
        for (field, hash) in [("password", &user.password), ("token", &user.token)] {
            if let Some(hash) = hash {
                check_hash(hash).map_err(|message| (key(field), message))?;
            }
        }
        let rules = [
            ("permissions.publish", &user.permissions.publish),
            ("permissions.subscribe", &user.permissions.subscribe),
        ];
        for (field, rule) in rules {
            for (list, patterns) in [("allow", &rule.allow), ("deny", &rule.deny)] {
                for pattern in patterns {
                    subject::validate_pattern(pattern, &subject::SubjectLimits::default())
                        .map_err(|err| {
                            (
                                key(&format!("{field}.{list}")),
                                format!("{pattern:?}: {err}"),
                            )
                        })?;
                }
            }
        }
    }
    Ok(())
}

/// Why an operation is refused: the rule that refused it, for the error
/// the client gets.
fn refusal(rule: &Rule, denied_by: Option<&String>, what: &str) -> String {
    match denied_by {
        Some(pattern) => format!("{what} deny {pattern:?}"),
        None => format!("not in {what} allow {:?}", rule.allow),
    }
}

/// The inbox (`_INBOX.<token>`) `pattern` lies under with a literal
/// token, if it does: a requester's reply subscription.
pub fn inbox_of(pattern: &str) -> Option<&str> {
    let mut tokens = subject::tokens(pattern);
    match (tokens.next(), tokens.next()) {
        (Some(subject::Token::Literal("_INBOX")), Some(subject::Token::Literal(token))) => {
            Some(&pattern[.."_INBOX.".len() + token.len()])
        }
        _ => None,
    }
}

/// Reply subjects a restricted connection may publish to: those of the
/// messages delivered to it lately.
#[derive(Debug, Default)]
pub struct Replies {
    order: std::collections::VecDeque<Box<str>>,
    known: HashSet<Box<str>>,
}

impl Replies {
    /// A message with reply subject `reply` was delivered.
    pub fn remember(&mut self, reply: &str) {
        if self.known.contains(reply) {
            return;
        }
        if self.order.len() >= REPLIES_REMEMBERED {
            if let Some(oldest) = self.order.pop_front() {
                self.known.remove(&oldest);
            }
        }
        self.order.push_back(reply.into());
        self.known.insert(reply.into());
    }

    pub fn contains(&self, subject: &str) -> bool {
        self.known.contains(subject)
    }

    /// Whether a remembered reply subject lies under `inbox`: a requester
    /// this connection answered.
    /// `inbox` is one as [`inbox_of`] gives it, and replies are literal
    /// subjects: a prefix check up to a token's end says as much.
    pub fn names_inbox(&self, inbox: &str) -> bool {
        self.order.iter().any(|reply| {
            reply
                .strip_prefix(inbox)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
        })
    }
}

impl Permissions {
    /// The `deny` pattern refusing a publish to `subject`, if any: no
    /// exemption overrides it.
    pub fn publish_denied(&self, subject: &str) -> Option<String> {
        self.publish
            .deny
            .iter()
            .find(|p| pattern_matches(p, subject))
            .map(|p| format!("publish deny {p:?}"))
    }

    /// The `deny` pattern refusing a subscription to `pattern`, if any.
    pub fn subscribe_denied(&self, pattern: &str) -> Option<String> {
        self.subscribe
            .deny
            .iter()
            .find(|p| patterns_overlap(p, pattern))
            .map(|p| format!("subscribe deny {p:?}"))
    }

    /// `Err` names the rule that refuses a publish to `subject`.
    pub fn may_publish(&self, subject: &str) -> Result<(), String> {
        let rule = &self.publish;
        let denied = rule.deny.iter().find(|p| pattern_matches(p, subject));
        let allowed =
            rule.allow.is_empty() || rule.allow.iter().any(|p| pattern_matches(p, subject));
        if denied.is_some() || !allowed {
            return Err(refusal(rule, denied, "publish"));
        }
        Ok(())
    }

    /// `Err` names the rule that refuses a subscription to `pattern`.
    pub fn may_subscribe(&self, pattern: &str) -> Result<(), String> {
        let rule = &self.subscribe;
        let denied = rule.deny.iter().find(|p| patterns_overlap(p, pattern));
        let allowed =
            rule.allow.is_empty() || rule.allow.iter().any(|p| pattern_covers(p, pattern));
        if denied.is_some() || !allowed {
            return Err(refusal(rule, denied, "subscribe"));
        }
        Ok(())
    }

    /// Whether nothing is restricted.
    pub fn allow_everything(&self) -> bool {
        *self == Permissions::default()
    }
}

/// Who a hello's credentials name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Login {
    /// A user, with the permissions to enforce (`None`: nothing restricted).
    User {
        name: String,
        permissions: Option<Arc<Permissions>>,
    },
    /// No user matched.
    Refused,
    /// This second's hash checks are spent: try again shortly.
    Busy,
}

/// The hash checks of this second are spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Busy;

/// Password and token hash checks (argon2: tens of milliseconds each, on
/// the broker's event loop) made per second at most; logins beyond are
/// answered `RateLimited` unchecked (a client retries), so a flood of
/// logins cannot hold the loop for more than this share of each second.
/// Checked credentials are remembered and cost nothing again.
pub const CHECKS_PER_SECOND: u32 = 8;

/// The users of a broker, with the credentials already checked.
pub(crate) struct Accounts {
    users: Vec<(User, Arc<Permissions>)>,
    /// Keyed hashes of (user, secret) pairs checked before.
    verified: Mutex<HashSet<[u8; 32]>>,
    key: [u8; 32],
    /// The hash of a random secret nobody knows, checked for unknown
    /// names.
    decoy: String,
    /// When this second of checks began, and how many were made in it.
    budget: Mutex<(Instant, u32)>,
}

impl Accounts {
    pub(crate) fn new(users: &[User]) -> Accounts {
        Accounts {
            users: users
                .iter()
                .map(|user| (user.clone(), Arc::new(user.permissions.clone())))
                .collect(),
            verified: Mutex::new(HashSet::new()),
            // Without randomness the cache is only less useful: a zero
            // key still never stores a secret.
            key: crate::session::link_auth::random_bytes().unwrap_or([0; 32]),
            // Made only where users log in with a secret.
            decoy: if users
                .iter()
                .any(|u| u.password.is_some() || u.token.is_some())
            {
                crate::session::link_auth::random_bytes::<16>()
                    .ok()
                    .and_then(|bytes| hash_secret(&format!("{bytes:?}")).ok())
                    .unwrap_or_default()
            } else {
                String::new()
            },
            budget: Mutex::new((Instant::now(), 0)),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.users.is_empty()
    }

    /// The key under which a checked (`name`, `hash`, `secret`) is
    /// remembered: a keyed hash, never the secret.
    fn memo_key(&self, name: &str, hash: &str, secret: &str) -> [u8; 32] {
        let mut hasher = blake3::Hasher::new_keyed(&self.key);
        hasher.update(name.as_bytes());
        hasher.update(&[0]);
        hasher.update(hash.as_bytes());
        hasher.update(&[0]);
        hasher.update(secret.as_bytes());
        hasher.finalize().into()
    }

    /// Whether `secret` was checked against `hash` for `name` before.
    fn remembered(&self, name: &str, hash: &str, secret: &str) -> bool {
        self.verified
            .lock()
            .contains(&self.memo_key(name, hash, secret))
    }

    /// Whether `secret` checks against `hash` (argon2), remembered per
    /// `name` when it does. The caller has spent a check.
    fn check(&self, name: &str, hash: &str, secret: &str) -> bool {
        let checks = PasswordHash::new(hash).is_ok_and(|hash| {
            Argon2::default()
                .verify_password(secret.as_bytes(), &hash)
                .is_ok()
        });
        if checks {
            let mut verified = self.verified.lock();
            if verified.len() >= VERIFIED_MAX {
                verified.clear();
            }
            verified.insert(self.memo_key(name, hash, secret));
        }
        checks
    }

    /// `checks` hash checks out of the budget of [`CHECKS_PER_SECOND`]. A
    /// login that needs more than a second's (a token login with more
    /// token users) may spend them when none are spent, and the seconds
    /// after pay for it: the checks average at most the budget.
    fn spend_checks(&self, checks: u32) -> Result<(), Busy> {
        let mut budget = self.budget.lock();
        let now = Instant::now();
        let seconds = now.duration_since(budget.0).as_secs();
        if seconds > 0 {
            let repaid = u32::try_from(seconds)
                .unwrap_or(u32::MAX)
                .saturating_mul(CHECKS_PER_SECOND);
            budget.1 = budget.1.saturating_sub(repaid);
            budget.0 += Duration::from_secs(seconds);
        }
        if budget.1 > 0 && budget.1.saturating_add(checks) > CHECKS_PER_SECOND {
            return Err(Busy);
        }
        budget.1 = budget.1.saturating_add(checks);
        Ok(())
    }

    /// The user whose `certificate` is `subject` (a verified client
    /// certificate's common name).
    pub(crate) fn login_by_certificate(&self, subject: &str) -> Login {
        let found = self
            .users
            .iter()
            .find(|(user, _)| user.certificate.as_deref() == Some(subject));
        match found {
            Some((user, permissions)) => Self::logged_in(user, permissions),
            None => Login::Refused,
        }
    }

    fn logged_in(user: &User, permissions: &Arc<Permissions>) -> Login {
        Login::User {
            name: user.name.clone(),
            permissions: (!permissions.allow_everything()).then(|| permissions.clone()),
        }
    }

    /// [`login_with`](Self::login_with), hashes checked as needed.
    #[cfg(test)]
    pub(crate) fn login(&self, name: Option<&str>, secret: &str) -> Login {
        self.login_with(name, secret, true)
            .unwrap_or(Login::Refused)
    }

    /// The user `name` with password `secret`, or (no name) the user whose
    /// token `secret` is. A login not remembered costs one check of this
    /// second's budget per hash it may check: one for a name, one per
    /// token user for a token. Without `may_hash`, `None` where a hash
    /// would be checked (a login neither remembered nor refused
    /// unchecked): the event loop hands such logins to the login thread.
    pub(crate) fn login_with(
        &self,
        name: Option<&str>,
        secret: &str,
        may_hash: bool,
    ) -> Option<Login> {
        let candidates: Vec<(&User, &Arc<Permissions>, &str)> = self
            .users
            .iter()
            .filter_map(|(user, permissions)| {
                let hash = match name {
                    Some(name) if user.name == name => user.password.as_deref(),
                    Some(_) => None,
                    None => user.token.as_deref(),
                }?;
                Some((user, permissions, hash))
            })
            .collect();
        // No token users, or no users at all: nothing to check or hide.
        if candidates.is_empty() && (name.is_none() || self.users.is_empty()) {
            return Some(Login::Refused);
        }
        let remembered = candidates
            .iter()
            .find(|(user, _, hash)| self.remembered(&user.name, hash, secret));
        if let Some((user, permissions, _)) = remembered {
            return Some(Self::logged_in(user, permissions));
        }
        if !may_hash {
            return None;
        }
        let checks = u32::try_from(candidates.len().max(1)).unwrap_or(u32::MAX);
        if self.spend_checks(checks).is_err() {
            return Some(Login::Busy);
        }
        if candidates.is_empty() {
            // An unknown name (or one without a password) takes as long to
            // refuse as a wrong password, so timing does not tell which
            // names exist.
            let _ = self.check("", &self.decoy, secret);
            return Some(Login::Refused);
        }
        let found = candidates
            .iter()
            .find(|(user, _, hash)| self.check(&user.name, hash, secret));
        Some(found.map_or(Login::Refused, |(user, permissions, _)| {
            Self::logged_in(user, permissions)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(allow: &[&str], deny: &[&str]) -> Rule {
        Rule {
            allow: allow.iter().map(|s| s.to_string()).collect(),
            deny: deny.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// A user's hash is an Argon2 one, at a cost within every published
    /// recommendation; anything else is refused when the configuration is
    /// read, saying why.
    #[test]
    fn user_hashes_are_argon2_within_bounds() {
        let ours = hash_secret("s3cret").expect("hashes");
        assert_eq!(check_hash(&ours), Ok(()));
        // Other variants, and RFC 9106's first recommendation (2 GiB).
        for variant in ["$argon2i$", "$argon2d$"] {
            assert_eq!(check_hash(&ours.replacen("$argon2id$", variant, 1)), Ok(()));
        }
        assert_eq!(
            check_hash(&ours.replacen("m=19456", "m=2097152", 1)),
            Ok(())
        );
        let costly = ours.replacen("m=19456", "m=4194304", 1);
        assert_ne!(costly, ours, "{ours}");
        let err = check_hash(&costly).unwrap_err();
        assert!(
            err.contains("m=4194304") && err.contains("efabus passwd"),
            "{err}"
        );
        for (passes, fine) in [("t=64,", true), ("t=1000,", false)] {
            let hash = ours.replacen("t=2,", passes, 1);
            assert_eq!(check_hash(&hash).is_ok(), fine, "{hash}");
        }
        for other in [
            "$pbkdf2-sha256$i=1000$c29tZXNhbHQ$aGFzaGhhc2hoYXNoaGFzaA",
            "s3cret",
        ] {
            let err = check_hash(other).unwrap_err();
            assert!(err.contains("not an Argon2 hash"), "{other}: {err}");
        }
    }

    #[test]
    fn permissions_allow_deny_and_replies() {
        let orders = Permissions {
            publish: rule(&["orders.>"], &["orders.secret"]),
            subscribe: rule(&["orders.>"], &["orders.secret"]),
        };
        assert!(orders.may_publish("orders.eu").is_ok());
        let err = orders.may_publish("orders.secret").unwrap_err();
        assert!(err.contains("publish deny \"orders.secret\""), "{err}");
        let err = orders.may_publish("billing.eu").unwrap_err();
        assert!(err.contains("not in publish allow"), "{err}");
        assert!(orders.may_subscribe("orders.eu").is_ok());
        assert!(orders.may_subscribe("orders.*.eu").is_ok());
        // Could receive orders.secret: refused, naming the rule.
        let err = orders.may_subscribe("orders.*").unwrap_err();
        assert!(err.contains("subscribe deny"), "{err}");
        assert!(orders.may_subscribe("orders.>").is_err());
        assert!(orders.may_subscribe(">").is_err());
        assert!(orders.may_subscribe("billing.eu").is_err());
        // Inboxes are not exempt here (the event loop grants replies).
        assert!(orders.may_subscribe("_INBOX.3f9a1c.>").is_err());
        assert!(orders.may_publish("_INBOX.3f9a1c.7").is_err());
        assert_eq!(inbox_of("_INBOX.3f9a1c.>"), Some("_INBOX.3f9a1c"));
        assert_eq!(inbox_of("_INBOX.3f9a1c.7"), Some("_INBOX.3f9a1c"));
        assert_eq!(inbox_of("_INBOX.*.>"), None);
        assert_eq!(inbox_of("_INBOX.>"), None);
        assert_eq!(inbox_of("orders.x"), None);
        assert_eq!(
            orders.subscribe_denied("orders.*").as_deref(),
            Some("subscribe deny \"orders.secret\"")
        );
        assert!(Permissions::default().may_subscribe(">").is_ok());

        let mut replies = Replies::default();
        for n in 0..=REPLIES_REMEMBERED {
            replies.remember(&format!("_INBOX.a.{n}"));
        }
        assert!(!replies.contains("_INBOX.a.0"), "the oldest is forgotten");
        assert!(replies.contains(&format!("_INBOX.a.{REPLIES_REMEMBERED}")));
    }

    #[test]
    fn users_log_in_with_a_password_or_a_token() {
        let users = vec![
            User {
                name: "alice".into(),
                password: Some(hash_secret("correct horse").unwrap()),
                permissions: Permissions {
                    publish: rule(&["orders.>"], &[]),
                    ..Permissions::default()
                },
                ..User::default()
            },
            User {
                name: "service".into(),
                token: Some(hash_secret("t0ken").unwrap()),
                ..User::default()
            },
        ];
        check_users(&users).expect("valid users");
        let accounts = Accounts::new(&users);
        match accounts.login(Some("alice"), "correct horse") {
            Login::User { name, permissions } => {
                assert_eq!(name, "alice");
                assert!(permissions.is_some());
            }
            Login::Refused | Login::Busy => panic!("alice's password"),
        }
        // Remembered: the same again needs no argon2.
        assert_eq!(accounts.verified.lock().len(), 1);
        assert!(matches!(
            accounts.login(Some("alice"), "correct horse"),
            Login::User { .. }
        ));
        assert_eq!(accounts.login(Some("alice"), "wrong"), Login::Refused);
        assert_eq!(accounts.login(Some("bob"), "correct horse"), Login::Refused);
        assert_eq!(accounts.login(Some("service"), "t0ken"), Login::Refused);
        assert_eq!(
            accounts.login(None, "t0ken"),
            Login::User {
                name: "service".into(),
                permissions: None
            }
        );
        assert_eq!(accounts.login(None, "correct horse"), Login::Refused);
    }

    #[test]
    fn hash_checks_are_bounded_per_second_and_remembered_logins_are_not() {
        let users = vec![User {
            name: "alice".into(),
            password: Some(hash_secret("right").unwrap()),
            ..User::default()
        }];
        let accounts = Accounts::new(&users);
        assert!(matches!(
            accounts.login(Some("alice"), "right"),
            Login::User { .. }
        ));
        let started = Instant::now();
        let mut outcomes = Vec::new();
        for _ in 0..CHECKS_PER_SECOND {
            outcomes.push(accounts.login(Some("alice"), "wrong"));
        }
        // The first login spent one check; so the last wrong one finds
        // the budget spent, unless a second passed meanwhile.
        if started.elapsed() < Duration::from_millis(900) {
            assert_eq!(outcomes.last(), Some(&Login::Busy), "{outcomes:?}");
            assert_eq!(
                outcomes.iter().filter(|o| **o == Login::Refused).count(),
                CHECKS_PER_SECOND as usize - 1
            );
            // A login checked before costs no check.
            assert!(matches!(
                accounts.login(Some("alice"), "right"),
                Login::User { .. }
            ));
            assert_eq!(accounts.login(Some("mallory"), "x"), Login::Busy);
        }
    }

    #[test]
    fn logins_with_nothing_to_check_spend_nothing() {
        let accounts = Accounts::new(&[]);
        for _ in 0..2 * CHECKS_PER_SECOND {
            assert_eq!(accounts.login(None, "a secret"), Login::Refused);
            assert_eq!(accounts.login(Some("anyone"), "x"), Login::Refused);
        }
        assert_eq!(accounts.budget.lock().1, 0);
    }

    /// Users `service-N` with tokens `token-N`.
    fn token_users(count: u32) -> Vec<User> {
        (0..count)
            .map(|n| User {
                name: format!("service-{n}"),
                token: Some(hash_secret(&format!("token-{n}")).unwrap()),
                ..User::default()
            })
            .collect()
    }

    #[test]
    fn a_token_login_costs_a_check_per_token_user() {
        let accounts = Accounts::new(&token_users(3));
        let started = Instant::now();
        assert_eq!(
            accounts.login(None, "token-2"),
            Login::User {
                name: "service-2".into(),
                permissions: None
            }
        );
        assert_eq!(accounts.login(None, "wrong"), Login::Refused);
        // Two logins of three checks each, and a third that would pass the
        // second's eight, unless the second is over.
        if started.elapsed() < Duration::from_millis(900) {
            assert_eq!(accounts.budget.lock().1, 6);
            assert_eq!(accounts.login(None, "wrong again"), Login::Busy);
        }
    }

    #[test]
    fn a_token_login_past_the_whole_budget_is_paid_for_by_the_seconds_after() {
        let accounts = Accounts::new(&token_users(CHECKS_PER_SECOND + 2));
        let last = CHECKS_PER_SECOND + 1;
        let started = Instant::now();
        assert_eq!(
            accounts.login(None, &format!("token-{last}")),
            Login::User {
                name: format!("service-{last}"),
                permissions: None
            }
        );
        if started.elapsed() < Duration::from_millis(900) {
            assert_eq!(accounts.login(None, "wrong"), Login::Busy);
        }
        // Ten checks spent: a second later two are still owed.
        let second_ago = Instant::now().checked_sub(Duration::from_secs(1));
        accounts.budget.lock().0 = second_ago.expect("the clock is past one second");
        assert_eq!(accounts.login(None, "wrong"), Login::Busy);
        assert_eq!(accounts.budget.lock().1, 2);
    }

    #[test]
    fn users_that_cannot_work_are_refused() {
        let plain = User {
            name: "alice".into(),
            password: Some("hunter2".into()),
            ..User::default()
        };
        let (key, message) = check_users(&[plain]).unwrap_err();
        assert_eq!(key, "auth.users[0].password");
        assert!(message.contains("efabus passwd"), "{message}");
        let hash = hash_secret("x").unwrap();
        let twice = User {
            name: "a".into(),
            password: Some(hash),
            ..User::default()
        };
        let (key, _) = check_users(&[twice.clone(), twice.clone()]).unwrap_err();
        assert_eq!(key, "auth.users[1].name");
        let bad_pattern = User {
            permissions: Permissions {
                subscribe: rule(&["orders..x"], &[]),
                ..Permissions::default()
            },
            ..twice
        };
        let (key, _) = check_users(&[bad_pattern]).unwrap_err();
        assert_eq!(key, "auth.users[0].permissions.subscribe.allow");
    }
}
