//! The `fi_info --verbose` text layout: printing [`FabricInfo`]s in it and
//! parsing it back.
//!
//! The printer writes exactly what libfabric's `fi_tostr` writes for the same
//! values, in the 1.x or 2.x layout recorded in [`FabricInfo::layout`], so a
//! dump read and printed again matches its input line for line. The parser
//! reads a whole `fi_info -v` output: text before the first `fi_info:` line
//! (the command line, log noise) is skipped, entries are separated by `---`
//! lines, and anything else that does not fit is a [`ParseError`] naming the
//! line and what was expected there: the first problem in reading order, an
//! entry that stops early as cut short, a list without its `]` as
//! unterminated. It never panics, whatever the input.

use std::fmt::{self, Write};

use thiserror::Error;

use super::enums::{AddrFormat, AvType, BusType, EpType, LinkState, Progress, Protocol};
use super::enums::{ResourceMgmt, Threading};
use super::flags::{Caps, CompOrder, Mode, MrMode, MsgOrder, OpFlags};
use super::info::{
    BusAttr, DeviceAttr, DomainAttr, EpAttr, ExtraFields, FabricAttr, FabricInfo, FiVersion,
    Layout, LinkAttr, Nic, PciAttr, RxAttr, TxAttr,
};

/// Why a dump could not be read.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("line {line}: expected {expected}, found {found:?}")]
pub struct ParseError {
    /// 1-based line number in the input.
    pub line: usize,
    /// What the parser wanted there.
    pub expected: String,
    /// What it found (shortened).
    pub found: String,
}

impl ParseError {
    fn new(line: usize, expected: impl Into<String>, found: &str) -> Self {
        // Keep messages readable when a line is huge.
        let found: String = found.chars().take(80).collect();
        ParseError {
            line,
            expected: expected.into(),
            found,
        }
    }
}

/// Indentation step of the layout.
const TAB: &str = "    ";

/// Deepest nesting the layout has is 4 (`nic` > `fi_bus_attr` >
/// `fi_pci_attr` > field); deeper input is refused before it can exhaust
/// the stack.
const MAX_DEPTH: usize = 6;

// ---------------------------------------------------------------- printing

/// Print infos as `fi_info --verbose` does: each entry preceded by `---`.
pub fn to_fi_info_text(infos: &[FabricInfo]) -> String {
    let mut out = String::new();
    for info in infos {
        out.push_str("---\n");
        // Writing to a String cannot fail.
        let _ = write!(out, "{info}");
    }
    out
}

impl fmt::Display for FabricInfo {
    /// One entry in the `fi_info --verbose` layout, from `fi_info:` to the
    /// `nic` lines, each line ending in a newline.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut p = Printer { f, depth: 0 };
        p.line("fi_info:")?;
        p.depth = 1;
        p.kv("caps", flags(&self.caps.names()))?;
        p.kv("mode", flags(&self.mode.names()))?;
        p.kv("addr_format", &self.addr_format)?;
        p.kv("src_addrlen", self.src_addrlen)?;
        p.kv("dest_addrlen", self.dest_addrlen)?;
        p.kv("src_addr", self.src_addr.as_deref().unwrap_or("(null)"))?;
        p.kv("dest_addr", self.dest_addr.as_deref().unwrap_or("(null)"))?;
        match self.handle {
            Some(handle) => p.kv("handle", format_args!("0x{handle:x}"))?,
            None => p.kv("handle", "(nil)")?,
        }
        p.extra(&self.extra)?;
        print_tx(&mut p, &self.tx_attr, self.layout)?;
        print_rx(&mut p, &self.rx_attr, self.layout)?;
        print_ep(&mut p, &self.ep_attr)?;
        print_domain(&mut p, &self.domain_attr, self.layout)?;
        print_fabric(&mut p, &self.fabric_attr)?;
        match &self.nic {
            None => p.kv("nic", "(nil)"),
            Some(nic) => print_nic(&mut p, nic),
        }
    }
}

struct Printer<'a, 'b> {
    f: &'a mut fmt::Formatter<'b>,
    depth: usize,
}

impl Printer<'_, '_> {
    fn indent(&mut self) -> fmt::Result {
        for _ in 0..self.depth {
            self.f.write_str(TAB)?;
        }
        Ok(())
    }

    fn line(&mut self, text: &str) -> fmt::Result {
        self.indent()?;
        self.f.write_str(text)?;
        self.f.write_char('\n')
    }

    fn kv(&mut self, key: &str, value: impl fmt::Display) -> fmt::Result {
        self.indent()?;
        writeln!(self.f, "{key}: {value}")
    }

    /// Open a group (`fi_tx_attr:`) whose lines follow one level deeper.
    fn open(&mut self, key: &str) -> fmt::Result {
        self.indent()?;
        writeln!(self.f, "{key}:")?;
        self.depth += 1;
        Ok(())
    }

    fn close(&mut self) {
        self.depth = self.depth.saturating_sub(1);
    }

    fn extra(&mut self, extra: &ExtraFields) -> fmt::Result {
        for (key, value) in extra {
            self.kv(key, value)?;
        }
        Ok(())
    }
}

/// A flag list as `fi_tostr` prints it: `[ A, B ]`, and `[  ]` when empty.
fn flags(names: &[String]) -> String {
    format!("[ {} ]", names.join(", "))
}

fn print_tx(p: &mut Printer<'_, '_>, tx: &TxAttr, layout: Layout) -> fmt::Result {
    p.open("fi_tx_attr")?;
    p.kv("caps", flags(&tx.caps.names()))?;
    p.kv("mode", flags(&tx.mode.names()))?;
    p.kv("op_flags", flags(&tx.op_flags.names()))?;
    p.kv("msg_order", flags(&tx.msg_order.names()))?;
    if layout == Layout::V1 {
        p.kv("comp_order", flags(&tx.comp_order.fi_names()))?;
    }
    p.kv("inject_size", tx.inject_size)?;
    p.kv("size", tx.size)?;
    p.kv("iov_limit", tx.iov_limit)?;
    p.kv("rma_iov_limit", tx.rma_iov_limit)?;
    p.kv("tclass", format_args!("0x{:x}", tx.tclass))?;
    p.extra(&tx.extra)?;
    p.close();
    Ok(())
}

fn print_rx(p: &mut Printer<'_, '_>, rx: &RxAttr, layout: Layout) -> fmt::Result {
    p.open("fi_rx_attr")?;
    p.kv("caps", flags(&rx.caps.names()))?;
    p.kv("mode", flags(&rx.mode.names()))?;
    p.kv("op_flags", flags(&rx.op_flags.names()))?;
    p.kv("msg_order", flags(&rx.msg_order.names()))?;
    if layout == Layout::V1 {
        p.kv("comp_order", flags(&rx.comp_order.fi_names()))?;
        p.kv("total_buffered_recv", rx.total_buffered_recv)?;
    }
    p.kv("size", rx.size)?;
    p.kv("iov_limit", rx.iov_limit)?;
    p.extra(&rx.extra)?;
    p.close();
    Ok(())
}

fn print_ep(p: &mut Printer<'_, '_>, ep: &EpAttr) -> fmt::Result {
    p.open("fi_ep_attr")?;
    p.kv("type", &ep.ep_type)?;
    p.kv("protocol", &ep.protocol)?;
    p.kv("protocol_version", ep.protocol_version)?;
    p.kv("max_msg_size", ep.max_msg_size)?;
    p.kv("msg_prefix_size", ep.msg_prefix_size)?;
    p.kv("max_order_raw_size", ep.max_order_raw_size)?;
    p.kv("max_order_war_size", ep.max_order_war_size)?;
    p.kv("max_order_waw_size", ep.max_order_waw_size)?;
    p.kv(
        "mem_tag_format",
        format_args!("0x{:016x}", ep.mem_tag_format),
    )?;
    p.kv("tx_ctx_cnt", ep.tx_ctx_cnt)?;
    p.kv("rx_ctx_cnt", ep.rx_ctx_cnt)?;
    p.kv("auth_key_size", ep.auth_key_size)?;
    p.extra(&ep.extra)?;
    p.close();
    Ok(())
}

fn print_domain(p: &mut Printer<'_, '_>, d: &DomainAttr, layout: Layout) -> fmt::Result {
    p.open("fi_domain_attr")?;
    p.kv("domain", format_args!("0x{:x}", d.domain))?;
    p.kv("name", &d.name)?;
    p.kv("threading", &d.threading)?;
    match layout {
        Layout::V1 => {
            p.kv("control_progress", &d.control_progress)?;
            p.kv("data_progress", &d.data_progress)?;
        }
        Layout::V2 => p.kv("progress", &d.data_progress)?,
    }
    p.kv("resource_mgmt", &d.resource_mgmt)?;
    p.kv("av_type", &d.av_type)?;
    p.kv("mr_mode", flags(&d.mr_mode.names()))?;
    p.kv("mr_key_size", d.mr_key_size)?;
    p.kv("cq_data_size", d.cq_data_size)?;
    p.kv("cq_cnt", d.cq_cnt)?;
    p.kv("ep_cnt", d.ep_cnt)?;
    p.kv("tx_ctx_cnt", d.tx_ctx_cnt)?;
    p.kv("rx_ctx_cnt", d.rx_ctx_cnt)?;
    p.kv("max_ep_tx_ctx", d.max_ep_tx_ctx)?;
    p.kv("max_ep_rx_ctx", d.max_ep_rx_ctx)?;
    p.kv("max_ep_stx_ctx", d.max_ep_stx_ctx)?;
    p.kv("max_ep_srx_ctx", d.max_ep_srx_ctx)?;
    p.kv("cntr_cnt", d.cntr_cnt)?;
    p.kv("mr_iov_limit", d.mr_iov_limit)?;
    p.kv("caps", flags(&d.caps.names()))?;
    p.kv("mode", flags(&d.mode.names()))?;
    p.kv("auth_key_size", d.auth_key_size)?;
    p.kv("max_err_data", d.max_err_data)?;
    p.kv("mr_cnt", d.mr_cnt)?;
    p.kv("tclass", format_args!("0x{:x}", d.tclass))?;
    p.extra(&d.extra)?;
    p.close();
    Ok(())
}

fn print_fabric(p: &mut Printer<'_, '_>, fa: &FabricAttr) -> fmt::Result {
    p.open("fi_fabric_attr")?;
    p.kv("name", &fa.name)?;
    p.kv("prov_name", &fa.prov_name)?;
    p.kv("prov_version", fa.prov_version)?;
    p.kv("api_version", fa.api_version)?;
    p.extra(&fa.extra)?;
    p.close();
    Ok(())
}

fn print_nic(p: &mut Printer<'_, '_>, nic: &Nic) -> fmt::Result {
    p.open("nic")?;

    let dev = &nic.device;
    p.open("fi_device_attr")?;
    p.kv("name", &dev.name)?;
    p.kv("device_id", &dev.device_id)?;
    p.kv("device_version", &dev.device_version)?;
    p.kv("vendor_id", &dev.vendor_id)?;
    p.kv("driver", &dev.driver)?;
    p.kv("firmware", &dev.firmware)?;
    p.extra(&dev.extra)?;
    p.close();

    let bus = &nic.bus;
    p.open("fi_bus_attr")?;
    p.kv("bus_type", &bus.bus_type)?;
    if let Some(pci) = &bus.pci {
        p.open("fi_pci_attr")?;
        p.kv("domain_id", pci.domain_id)?;
        p.kv("bus_id", pci.bus_id)?;
        p.kv("device_id", pci.device_id)?;
        p.kv("function_id", pci.function_id)?;
        p.extra(&pci.extra)?;
        p.close();
    }
    p.extra(&bus.extra)?;
    p.close();

    let link = &nic.link;
    p.open("fi_link_attr")?;
    p.kv("address", &link.address)?;
    p.kv("mtu", link.mtu)?;
    p.kv("speed", link.speed)?;
    p.kv("state", &link.state)?;
    p.kv("network_type", &link.network_type)?;
    p.extra(&link.extra)?;
    p.close();

    p.extra(&nic.extra)?;
    p.close();
    Ok(())
}

// ----------------------------------------------------------------- parsing

/// One `key: value` line and the lines indented under it.
#[derive(Debug)]
struct Node<'a> {
    line: usize,
    key: &'a str,
    /// Text after `key:` with the single separating space removed; empty
    /// for a group header.
    value: &'a str,
    /// The whole line, for error messages.
    text: &'a str,
    children: Vec<Node<'a>>,
}

/// One input line after splitting off its indentation.
struct Line<'a> {
    number: usize,
    indent: usize,
    body: &'a str,
    text: &'a str,
}

/// Parse the output of `fi_info --verbose` (one or more entries).
///
/// Text before the first `fi_info:` line is ignored; after it, only entries,
/// `---` separators and blank lines may appear.
pub fn parse_fi_info_dump(text: &str) -> Result<Vec<FabricInfo>, ParseError> {
    let lines: Vec<Line<'_>> = text
        .lines()
        .enumerate()
        .map(|(i, raw)| {
            let raw = raw.strip_suffix('\r').unwrap_or(raw);
            let body = raw.trim_start_matches(' ');
            Line {
                number: i + 1,
                indent: raw.len() - body.len(),
                body,
                text: raw,
            }
        })
        .collect();

    let Some(start) = lines
        .iter()
        .position(|l| l.indent == 0 && l.body.trim_end() == "fi_info:")
    else {
        let last = lines.len().max(1);
        return Err(ParseError::new(last, "a `fi_info:` line", "end of input"));
    };

    let mut infos = Vec::new();
    let mut pos = start;
    while pos < lines.len() {
        let line = &lines[pos];
        let body = line.body.trim_end();
        if body.is_empty() || (line.indent == 0 && body == "---") {
            pos += 1;
            continue;
        }
        if line.indent != 0 || body != "fi_info:" {
            return Err(ParseError::new(
                line.number,
                "`fi_info:` or `---` at the start of a line",
                line.text,
            ));
        }
        let header = line.number;
        pos += 1;
        let end = entry_end(&lines, pos);
        let mut children = Vec::new();
        if let Some(first) = lines[pos..end]
            .iter()
            .find(|l| !l.body.trim_end().is_empty())
        {
            let indent = first.indent;
            children = parse_block(&lines[..end], &mut pos, indent, 1)?;
            // parse_block stops at a line indented less than the entry's
            // fields; inside an entry that is always a mistake.
            if let Some(stray) = lines[pos..end]
                .iter()
                .find(|l| !l.body.trim_end().is_empty())
            {
                return Err(ParseError::new(
                    stray.number,
                    format!("a line indented by {indent} spaces"),
                    stray.text,
                ));
            }
        }
        pos = end;
        let root = Node {
            line: header,
            key: "fi_info",
            value: "",
            text: "fi_info:",
            children,
        };
        infos.push(info_from_node(&root)?);
    }
    Ok(infos)
}

/// Index of the first line after `pos` that ends the current entry: a line
/// with no indentation that is not blank.
fn entry_end(lines: &[Line<'_>], pos: usize) -> usize {
    lines[pos..]
        .iter()
        .position(|l| l.indent == 0 && !l.body.trim_end().is_empty())
        .map_or(lines.len(), |off| pos + off)
}

/// Parse sibling lines at `indent`, each with the deeper lines under it.
fn parse_block<'a>(
    lines: &[Line<'a>],
    pos: &mut usize,
    indent: usize,
    depth: usize,
) -> Result<Vec<Node<'a>>, ParseError> {
    let mut nodes: Vec<Node<'a>> = Vec::new();
    if depth > MAX_DEPTH {
        let (number, text) = lines.get(*pos).map_or((0, ""), |l| (l.number, l.text));
        return Err(ParseError::new(
            number,
            format!("at most {MAX_DEPTH} levels of indentation"),
            text,
        ));
    }
    while *pos < lines.len() {
        let line = &lines[*pos];
        if line.body.trim_end().is_empty() {
            *pos += 1;
            continue;
        }
        if line.indent < indent {
            break;
        }
        if line.indent > indent {
            return Err(ParseError::new(
                line.number,
                format!("a line indented by {indent} spaces"),
                line.text,
            ));
        }
        let Some((key, rest)) = line.body.split_once(':') else {
            return Err(ParseError::new(line.number, "`key: value`", line.text));
        };
        if key.is_empty() || key.contains(char::is_whitespace) {
            return Err(ParseError::new(
                line.number,
                "a field name before `:`",
                line.text,
            ));
        }
        let value = rest.strip_prefix(' ').unwrap_or(rest);
        *pos += 1;
        // Lines indented deeper than this one belong to it.
        let mut children = Vec::new();
        if let Some(next) = lines[*pos..].iter().find(|l| !l.body.trim_end().is_empty()) {
            if next.indent > indent {
                children = parse_block(lines, pos, next.indent, depth + 1)?;
            }
        }
        nodes.push(Node {
            line: line.number,
            key,
            value,
            text: line.text,
            children,
        });
    }
    Ok(nodes)
}

impl Node<'_> {
    /// The node on the last line of this node and everything under it.
    fn last(&self) -> &Self {
        self.children.last().map_or(self, Node::last)
    }

    /// The child with this key, if any.
    fn child(&self, key: &str) -> Option<&Self> {
        self.children.iter().find(|n| n.key == key)
    }
}

/// The fields of one group, taken out by name; what is left over is either
/// kept as extra lines or reported.
///
/// Fields are taken in the order `fi_info` prints them, so the first
/// problem in the text is the one reported.
struct Fields<'n, 'a> {
    group: &'n Node<'a>,
    used: Vec<bool>,
    /// Last line of the whole entry: a field missing after everything a
    /// group holds, in a group that reaches this line, means the entry was
    /// cut short.
    entry_last: usize,
}

impl<'n, 'a> Fields<'n, 'a> {
    fn new(group: &'n Node<'a>, entry_last: usize) -> Result<Self, ParseError> {
        if !group.value.trim_end().is_empty() {
            return Err(ParseError::new(
                group.line,
                format!("`{}:` followed by its fields on the next lines", group.key),
                group.text,
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for node in &group.children {
            if !seen.insert(node.key) {
                return Err(ParseError::new(
                    node.line,
                    format!("`{}` only once in `{}`", node.key, group.key),
                    node.text,
                ));
            }
        }
        Ok(Fields {
            group,
            used: vec![false; group.children.len()],
            entry_last,
        })
    }

    fn find(&mut self, key: &str) -> Option<&'n Node<'a>> {
        let group: &'n Node<'a> = self.group;
        let i = group.children.iter().position(|n| n.key == key)?;
        self.used[i] = true;
        Some(&group.children[i])
    }

    fn has(&self, key: &str) -> bool {
        self.group.children.iter().any(|n| n.key == key)
    }

    fn node(&mut self, key: &str) -> Result<&'n Node<'a>, ParseError> {
        let group = self.group;
        if let Some(node) = self.find(key) {
            return Ok(node);
        }
        // Everything the group holds came before this field and nothing
        // follows the group: the text stops here, the field was not left out.
        let last = group.last();
        if self.used.iter().all(|&used| used) && last.line == self.entry_last {
            return Err(ParseError::new(
                last.line,
                format!("`{key}` in `{}`, but the entry ended before it", group.key),
                last.text,
            ));
        }
        // Point at the line where the field should have been: the last
        // line of the group, or its header when it is empty.
        let (line, found) = group
            .children
            .last()
            .map_or((group.line, group.text), |n| (n.line, n.text));
        Err(ParseError::new(
            line,
            format!("`{key}` in `{}`", group.key),
            found,
        ))
    }

    /// A scalar field: its value text.
    fn scalar(&mut self, key: &str) -> Result<(&'n Node<'a>, &'a str), ParseError> {
        let node = self.node(key)?;
        if let Some(child) = node.children.first() {
            return Err(ParseError::new(
                child.line,
                format!("no lines indented under `{key}`"),
                child.text,
            ));
        }
        Ok((node, node.value))
    }

    fn text(&mut self, key: &str) -> Result<String, ParseError> {
        Ok(self.scalar(key)?.1.to_string())
    }

    fn u64(&mut self, key: &str) -> Result<u64, ParseError> {
        let (node, value) = self.scalar(key)?;
        value.trim_end().parse::<u64>().map_err(|_| {
            ParseError::new(
                node.line,
                format!("an unsigned number for `{key}`"),
                node.text,
            )
        })
    }

    fn u32(&mut self, key: &str) -> Result<u32, ParseError> {
        let (node, value) = self.scalar(key)?;
        value.trim_end().parse::<u32>().map_err(|_| {
            ParseError::new(
                node.line,
                format!("a 32-bit unsigned number for `{key}`"),
                node.text,
            )
        })
    }

    fn small<T: TryFrom<u64>>(&mut self, key: &str) -> Result<T, ParseError> {
        let (node, value) = self.scalar(key)?;
        value
            .trim_end()
            .parse::<u64>()
            .ok()
            .and_then(|v| T::try_from(v).ok())
            .ok_or_else(|| {
                ParseError::new(
                    node.line,
                    format!("an unsigned number in range for `{key}`"),
                    node.text,
                )
            })
    }

    fn hex(&mut self, key: &str) -> Result<u64, ParseError> {
        let (node, value) = self.scalar(key)?;
        parse_hex(value.trim_end()).ok_or_else(|| {
            ParseError::new(
                node.line,
                format!("a 0x-prefixed hex number for `{key}`"),
                node.text,
            )
        })
    }

    fn hex32(&mut self, key: &str) -> Result<u32, ParseError> {
        let (node, value) = self.scalar(key)?;
        parse_hex(value.trim_end())
            .and_then(|v| u32::try_from(v).ok())
            .ok_or_else(|| {
                ParseError::new(
                    node.line,
                    format!("a 32-bit 0x-prefixed hex number for `{key}`"),
                    node.text,
                )
            })
    }

    fn version(&mut self, key: &str) -> Result<FiVersion, ParseError> {
        let (node, value) = self.scalar(key)?;
        let parsed = value.trim_end().split_once('.').and_then(|(major, minor)| {
            Some(FiVersion::new(major.parse().ok()?, minor.parse().ok()?))
        });
        parsed.ok_or_else(|| {
            ParseError::new(node.line, format!("`major.minor` for `{key}`"), node.text)
        })
    }

    fn name_list(&mut self, key: &str) -> Result<Vec<&'a str>, ParseError> {
        let (node, value) = self.scalar(key)?;
        let Some(open) = value.trim_end().strip_prefix('[') else {
            return Err(ParseError::new(
                node.line,
                format!("a flag list `[ ... ]` for `{key}`"),
                node.text,
            ));
        };
        let inner = open.strip_suffix(']').ok_or_else(|| {
            ParseError::new(
                node.line,
                format!("`]` closing the `{key}` list, which is unterminated"),
                node.text,
            )
        })?;
        let names: Vec<&'a str> = inner
            .split(',')
            .map(str::trim)
            .filter(|name| !name.is_empty())
            .collect();
        // A flag set holds each name once, checked name by name: a list far
        // longer than libfabric has flags is no dump's.
        if names.len() > MAX_FLAG_NAMES {
            return Err(ParseError::new(
                node.line,
                format!(
                    "at most {MAX_FLAG_NAMES} flags in `{key}`, not {}",
                    names.len()
                ),
                node.text,
            ));
        }
        Ok(names)
    }

    fn enum_name(&mut self, key: &str) -> Result<&'a str, ParseError> {
        let (node, value) = self.scalar(key)?;
        let value = value.trim_end();
        if value.is_empty() {
            return Err(ParseError::new(
                node.line,
                format!("a value for `{key}`"),
                node.text,
            ));
        }
        Ok(value)
    }

    /// A nested group, required.
    fn group(&mut self, key: &str) -> Result<Fields<'n, 'a>, ParseError> {
        let node = self.node(key)?;
        Fields::new(node, self.entry_last)
    }

    /// Left-over scalar lines become extra fields; a left-over group is an
    /// error since its shape is unknown.
    fn finish(self) -> Result<ExtraFields, ParseError> {
        let mut extra = Vec::new();
        for (node, used) in self.group.children.iter().zip(&self.used) {
            if *used {
                continue;
            }
            if let Some(child) = node.children.first() {
                return Err(ParseError::new(
                    child.line,
                    format!(
                        "a known field of `{}` (unknown group `{}`)",
                        self.group.key, node.key
                    ),
                    child.text,
                ));
            }
            extra.push((node.key.to_string(), node.value.to_string()));
        }
        Ok(extra)
    }
}

/// Most names one flag list of a dump may hold (libfabric's largest set,
/// `caps`, has about 40).
const MAX_FLAG_NAMES: usize = 256;

fn parse_hex(text: &str) -> Option<u64> {
    let digits = text.strip_prefix("0x")?;
    if digits.is_empty() {
        return None;
    }
    u64::from_str_radix(digits, 16).ok()
}

macro_rules! flag_field {
    ($fields:expr, $key:expr, $ty:ty) => {{
        let mut set = <$ty>::empty();
        for name in $fields.name_list($key)? {
            set.insert_name(name);
        }
        set
    }};
}

/// Which `fi_info` layout an entry is in. The domain attributes show it
/// (`control_progress` in 1.x, `progress` in 2.x); without them, as in an
/// entry cut short, the transmit attributes do as far as they go (1.x has
/// `comp_order` before `inject_size`).
fn layout_of(root: &Node<'_>) -> Layout {
    if let Some(domain) = root.child("fi_domain_attr") {
        if domain.child("control_progress").is_some() {
            return Layout::V1;
        }
        if domain.child("progress").is_some() {
            return Layout::V2;
        }
    }
    match root.child("fi_tx_attr") {
        Some(tx) if tx.child("comp_order").is_none() && tx.child("inject_size").is_some() => {
            Layout::V2
        }
        _ => Layout::V1,
    }
}

fn info_from_node(root: &Node<'_>) -> Result<FabricInfo, ParseError> {
    let mut top = Fields::new(root, root.last().line)?;
    // The tx and rx groups need the layout to know which fields to expect.
    let layout = layout_of(root);

    let caps = flag_field!(top, "caps", Caps);
    let mode = flag_field!(top, "mode", Mode);
    let addr_format = AddrFormat::from_name(top.enum_name("addr_format")?);
    let src_addrlen = top.u64("src_addrlen")?;
    let dest_addrlen = top.u64("dest_addrlen")?;
    let src_addr = optional_text(top.text("src_addr")?, "(null)");
    let dest_addr = optional_text(top.text("dest_addr")?, "(null)");
    let handle = {
        let (node, value) = top.scalar("handle")?;
        match value.trim_end() {
            "(nil)" => None,
            other => Some(parse_hex(other).ok_or_else(|| {
                ParseError::new(
                    node.line,
                    "`(nil)` or a hex pointer for `handle`",
                    node.text,
                )
            })?),
        }
    };
    let tx_attr = parse_tx(&mut top, layout)?;
    let rx_attr = parse_rx(&mut top, layout)?;
    let ep_attr = parse_ep(&mut top)?;
    let mut domain_fields = top.group("fi_domain_attr")?;
    let domain_attr = parse_domain(&mut domain_fields, layout)?;
    let domain_extra = domain_fields.finish()?;
    let fabric_attr = parse_fabric(&mut top)?;
    let nic = parse_nic(&mut top)?;
    let extra = top.finish()?;

    Ok(FabricInfo {
        layout,
        caps,
        mode,
        addr_format,
        src_addrlen,
        dest_addrlen,
        src_addr,
        dest_addr,
        handle,
        tx_attr,
        rx_attr,
        ep_attr,
        domain_attr: DomainAttr {
            extra: domain_extra,
            ..domain_attr
        },
        fabric_attr,
        nic,
        extra,
    })
}

fn optional_text(text: String, none: &str) -> Option<String> {
    (text != none).then_some(text)
}

fn parse_tx(top: &mut Fields<'_, '_>, layout: Layout) -> Result<TxAttr, ParseError> {
    let mut g = top.group("fi_tx_attr")?;
    let caps = flag_field!(g, "caps", Caps);
    let mode = flag_field!(g, "mode", Mode);
    let op_flags = flag_field!(g, "op_flags", OpFlags);
    let msg_order = flag_field!(g, "msg_order", MsgOrder);
    let comp_order = match layout {
        Layout::V1 => comp_order_field(&mut g)?,
        Layout::V2 => CompOrder::empty(),
    };
    Ok(TxAttr {
        caps,
        mode,
        op_flags,
        msg_order,
        comp_order,
        inject_size: g.u64("inject_size")?,
        size: g.u64("size")?,
        iov_limit: g.u64("iov_limit")?,
        rma_iov_limit: g.u64("rma_iov_limit")?,
        tclass: g.hex32("tclass")?,
        extra: g.finish()?,
    })
}

fn comp_order_field(g: &mut Fields<'_, '_>) -> Result<CompOrder, ParseError> {
    let mut set = CompOrder::empty();
    for name in g.name_list("comp_order")? {
        set.insert_fi_name(name);
    }
    Ok(set)
}

fn parse_rx(top: &mut Fields<'_, '_>, layout: Layout) -> Result<RxAttr, ParseError> {
    let mut g = top.group("fi_rx_attr")?;
    let caps = flag_field!(g, "caps", Caps);
    let mode = flag_field!(g, "mode", Mode);
    let op_flags = flag_field!(g, "op_flags", OpFlags);
    let msg_order = flag_field!(g, "msg_order", MsgOrder);
    let (comp_order, total_buffered_recv) = match layout {
        Layout::V1 => (comp_order_field(&mut g)?, g.u64("total_buffered_recv")?),
        Layout::V2 => (CompOrder::empty(), 0),
    };
    Ok(RxAttr {
        caps,
        mode,
        op_flags,
        msg_order,
        comp_order,
        total_buffered_recv,
        size: g.u64("size")?,
        iov_limit: g.u64("iov_limit")?,
        extra: g.finish()?,
    })
}

fn parse_ep(top: &mut Fields<'_, '_>) -> Result<EpAttr, ParseError> {
    let mut g = top.group("fi_ep_attr")?;
    Ok(EpAttr {
        ep_type: EpType::from_name(g.enum_name("type")?),
        protocol: Protocol::from_name(g.enum_name("protocol")?),
        protocol_version: g.u32("protocol_version")?,
        max_msg_size: g.u64("max_msg_size")?,
        msg_prefix_size: g.u64("msg_prefix_size")?,
        max_order_raw_size: g.u64("max_order_raw_size")?,
        max_order_war_size: g.u64("max_order_war_size")?,
        max_order_waw_size: g.u64("max_order_waw_size")?,
        mem_tag_format: g.hex("mem_tag_format")?,
        tx_ctx_cnt: g.u64("tx_ctx_cnt")?,
        rx_ctx_cnt: g.u64("rx_ctx_cnt")?,
        auth_key_size: g.u64("auth_key_size")?,
        extra: g.finish()?,
    })
}

/// The domain group's fields; its extras are collected by the caller.
fn parse_domain(g: &mut Fields<'_, '_>, layout: Layout) -> Result<DomainAttr, ParseError> {
    let domain = g.hex("domain")?;
    let name = g.text("name")?;
    let threading = Threading::from_name(g.enum_name("threading")?);
    let (control_progress, data_progress) = match layout {
        Layout::V1 => (
            Progress::from_name(g.enum_name("control_progress")?),
            Progress::from_name(g.enum_name("data_progress")?),
        ),
        Layout::V2 => {
            let progress = Progress::from_name(g.enum_name("progress")?);
            (progress.clone(), progress)
        }
    };
    Ok(DomainAttr {
        domain,
        name,
        threading,
        control_progress,
        data_progress,
        resource_mgmt: ResourceMgmt::from_name(g.enum_name("resource_mgmt")?),
        av_type: AvType::from_name(g.enum_name("av_type")?),
        mr_mode: flag_field!(g, "mr_mode", MrMode),
        mr_key_size: g.u64("mr_key_size")?,
        cq_data_size: g.u64("cq_data_size")?,
        cq_cnt: g.u64("cq_cnt")?,
        ep_cnt: g.u64("ep_cnt")?,
        tx_ctx_cnt: g.u64("tx_ctx_cnt")?,
        rx_ctx_cnt: g.u64("rx_ctx_cnt")?,
        max_ep_tx_ctx: g.u64("max_ep_tx_ctx")?,
        max_ep_rx_ctx: g.u64("max_ep_rx_ctx")?,
        max_ep_stx_ctx: g.u64("max_ep_stx_ctx")?,
        max_ep_srx_ctx: g.u64("max_ep_srx_ctx")?,
        cntr_cnt: g.u64("cntr_cnt")?,
        mr_iov_limit: g.u64("mr_iov_limit")?,
        caps: flag_field!(g, "caps", Caps),
        mode: flag_field!(g, "mode", Mode),
        auth_key_size: g.u64("auth_key_size")?,
        max_err_data: g.u64("max_err_data")?,
        mr_cnt: g.u64("mr_cnt")?,
        tclass: g.hex32("tclass")?,
        extra: Vec::new(),
    })
}

fn parse_fabric(top: &mut Fields<'_, '_>) -> Result<FabricAttr, ParseError> {
    let mut g = top.group("fi_fabric_attr")?;
    Ok(FabricAttr {
        name: g.text("name")?,
        prov_name: g.text("prov_name")?,
        prov_version: g.version("prov_version")?,
        api_version: g.version("api_version")?,
        extra: g.finish()?,
    })
}

fn parse_nic(top: &mut Fields<'_, '_>) -> Result<Option<Nic>, ParseError> {
    let node = top.node("nic")?;
    if node.children.is_empty() && node.value.trim_end() == "(nil)" {
        return Ok(None);
    }
    let mut nic = Fields::new(node, top.entry_last)?;

    let mut d = nic.group("fi_device_attr")?;
    let device = DeviceAttr {
        name: d.text("name")?,
        device_id: d.text("device_id")?,
        device_version: d.text("device_version")?,
        vendor_id: d.text("vendor_id")?,
        driver: d.text("driver")?,
        firmware: d.text("firmware")?,
        extra: d.finish()?,
    };

    let mut b = nic.group("fi_bus_attr")?;
    let bus_type = BusType::from_name(b.enum_name("bus_type")?);
    let pci = if b.has("fi_pci_attr") {
        let mut pa = b.group("fi_pci_attr")?;
        Some(PciAttr {
            domain_id: pa.small("domain_id")?,
            bus_id: pa.small("bus_id")?,
            device_id: pa.small("device_id")?,
            function_id: pa.small("function_id")?,
            extra: pa.finish()?,
        })
    } else {
        None
    };
    let bus = BusAttr {
        bus_type,
        pci,
        extra: b.finish()?,
    };

    let mut l = nic.group("fi_link_attr")?;
    let link = LinkAttr {
        address: l.text("address")?,
        mtu: l.u64("mtu")?,
        speed: l.u64("speed")?,
        state: LinkState::from_name(l.enum_name("state")?),
        network_type: l.text("network_type")?,
        extra: l.finish()?,
    };

    Ok(Some(Nic {
        device,
        bus,
        link,
        extra: nic.finish()?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_parsing() {
        assert_eq!(parse_hex("0x0"), Some(0));
        assert_eq!(parse_hex("0xaaaaaaaaaaaaaaaa"), Some(0xaaaa_aaaa_aaaa_aaaa));
        assert_eq!(parse_hex("0x"), None);
        assert_eq!(parse_hex("12"), None);
        assert_eq!(parse_hex("0x1ffffffffffffffff"), None);
    }

    #[test]
    fn no_entry_is_an_error() {
        let err = parse_fi_info_dump("just some text\n").unwrap_err();
        assert_eq!(err.line, 1);
        assert!(err.expected.contains("fi_info:"));
        assert!(parse_fi_info_dump("").is_err());
    }

    #[test]
    fn synthesized_info_round_trips() {
        let infos = vec![FabricInfo::tcp(None), FabricInfo::mem()];
        let text = to_fi_info_text(&infos);
        assert_eq!(parse_fi_info_dump(&text).unwrap(), infos);
    }
}
