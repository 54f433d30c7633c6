//! HTTP/2 frames (RFC 9113) as the mount's receiver reads them: a reader that knows nothing of sockets
//! ([`FrameReader`]: it is told each piece of the connection's bytes and says what it needs next and what
//! each frame meant), the frames a client writes, and a client's request headers in HPACK (RFC 7541).
//!
//! The reader never holds a DATA frame's payload: it says how many bytes of which stream come next
//! ([`Next::Data`]) and its caller reads them from the socket wherever that stream's body goes (into
//! the mount's buffers straight, so a body is copied once, by the kernel, out of the socket). Every other
//! frame is small and read whole. A connection's bytes are hostile input: every
//! length, padding, flag and stream id is checked here, a header block has a bounded size however many
//! CONTINUATION frames carry it, and what breaks the protocol is a [`FrameError`] naming the RFC's
//! error code. `fuzz/fuzz_targets/frames.rs` feeds the reader arbitrary bytes.

use std::fmt;

/// What a client sends first on a connection, before its SETTINGS.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The bytes of a frame's header.
pub const HEADER_LEN: usize = 9;
/// The largest frame anyone may send before SETTINGS say otherwise, and the least a peer may allow.
pub const DEFAULT_MAX_FRAME: u32 = 16_384;
/// The largest frame size a SETTINGS_MAX_FRAME_SIZE may announce.
pub const MAX_FRAME_LIMIT: u32 = (1 << 24) - 1;
/// A window's initial size on both sides before SETTINGS (the connection's stays so until updated).
pub const DEFAULT_WINDOW: u32 = 65_535;
/// The largest a flow-control window may grow.
pub const MAX_WINDOW: u32 = (1 << 31) - 1;
/// The largest header block (all its frames) the reader assembles: a response's head is a few hundred
/// bytes, so this only bounds what a hostile peer can make the reader hold.
pub const MAX_HEADER_BLOCK: usize = 256 << 10;

/// Frame types.
pub mod kind {
    pub const DATA: u8 = 0x0;
    pub const HEADERS: u8 = 0x1;
    pub const PRIORITY: u8 = 0x2;
    pub const RST_STREAM: u8 = 0x3;
    pub const SETTINGS: u8 = 0x4;
    pub const PUSH_PROMISE: u8 = 0x5;
    pub const PING: u8 = 0x6;
    pub const GOAWAY: u8 = 0x7;
    pub const WINDOW_UPDATE: u8 = 0x8;
    pub const CONTINUATION: u8 = 0x9;
}

/// Frame flags (each meaningful only on some types).
pub mod flag {
    pub const END_STREAM: u8 = 0x1;
    pub const ACK: u8 = 0x1;
    pub const END_HEADERS: u8 = 0x4;
    pub const PADDED: u8 = 0x8;
    pub const PRIORITY: u8 = 0x20;
}

/// SETTINGS parameters.
pub mod setting {
    pub const HEADER_TABLE_SIZE: u16 = 0x1;
    pub const ENABLE_PUSH: u16 = 0x2;
    pub const MAX_CONCURRENT_STREAMS: u16 = 0x3;
    pub const INITIAL_WINDOW_SIZE: u16 = 0x4;
    pub const MAX_FRAME_SIZE: u16 = 0x5;
    pub const MAX_HEADER_LIST_SIZE: u16 = 0x6;
}

/// Error codes (RST_STREAM, GOAWAY).
pub mod code {
    pub const NO_ERROR: u32 = 0x0;
    pub const PROTOCOL_ERROR: u32 = 0x1;
    pub const INTERNAL_ERROR: u32 = 0x2;
    pub const FLOW_CONTROL_ERROR: u32 = 0x3;
    pub const STREAM_CLOSED: u32 = 0x5;
    pub const FRAME_SIZE_ERROR: u32 = 0x6;
    pub const REFUSED_STREAM: u32 = 0x7;
    pub const CANCEL: u32 = 0x8;
    pub const COMPRESSION_ERROR: u32 = 0x9;
    pub const ENHANCE_YOUR_CALM: u32 = 0xb;
}

/// The name of an error code, for messages.
pub fn code_name(code: u32) -> &'static str {
    match code {
        0x0 => "NO_ERROR",
        0x1 => "PROTOCOL_ERROR",
        0x2 => "INTERNAL_ERROR",
        0x3 => "FLOW_CONTROL_ERROR",
        0x4 => "SETTINGS_TIMEOUT",
        0x5 => "STREAM_CLOSED",
        0x6 => "FRAME_SIZE_ERROR",
        0x7 => "REFUSED_STREAM",
        0x8 => "CANCEL",
        0x9 => "COMPRESSION_ERROR",
        0xa => "CONNECT_ERROR",
        0xb => "ENHANCE_YOUR_CALM",
        0xc => "INADEQUATE_SECURITY",
        0xd => "HTTP_1_1_REQUIRED",
        _ => "unknown error code",
    }
}

/// A frame's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    /// The payload's length.
    pub len: u32,
    pub kind: u8,
    pub flags: u8,
    /// The stream (the reserved bit cleared).
    pub stream: u32,
}

impl Head {
    pub fn parse(b: &[u8; HEADER_LEN]) -> Head {
        Head {
            len: u32::from_be_bytes([0, b[0], b[1], b[2]]),
            kind: b[3],
            flags: b[4],
            stream: u32::from_be_bytes([b[5], b[6], b[7], b[8]]) & MAX_WINDOW,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let l = self.len.to_be_bytes();
        let s = self.stream.to_be_bytes();
        [l[1], l[2], l[3], self.kind, self.flags, s[0], s[1], s[2], s[3]]
    }

    fn has(&self, f: u8) -> bool {
        self.flags & f != 0
    }
}

/// A connection error: the peer broke the protocol, and the connection ends (with a GOAWAY of `code`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameError {
    pub code: u32,
    pub what: String,
}

impl FrameError {
    fn new(code: u32, what: impl Into<String>) -> Self {
        FrameError { code, what: what.into() }
    }
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HTTP/2 {}: {}", code_name(self.code), self.what)
    }
}

impl std::error::Error for FrameError {}

/// What the reader needs next from the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// A frame's header: [`FrameReader::feed`] exactly [`HEADER_LEN`] bytes.
    Head,
    /// A small payload (or a DATA frame's pad length): feed exactly this many bytes.
    Payload(usize),
    /// This many bytes of a DATA frame's body for `stream`: the caller puts them where the stream's body
    /// goes (or drops them), then calls [`FrameReader::data_read`].
    Data { stream: u32, len: usize },
    /// Padding to drop: the caller discards this many bytes, then calls [`FrameReader::skipped`].
    Skip(usize),
}

/// What a frame meant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A whole header block (its CONTINUATION frames joined, padding and priority removed).
    Headers {
        stream: u32,
        block: Vec<u8>,
        end_stream: bool,
    },
    /// A DATA frame has been read whole: `flow` bytes count against the windows (its payload with
    /// padding).
    DataEnd {
        stream: u32,
        flow: u32,
        end_stream: bool,
    },
    Reset {
        stream: u32,
        code: u32,
    },
    Settings {
        ack: bool,
        values: Vec<(u16, u32)>,
    },
    Ping {
        ack: bool,
        data: [u8; 8],
    },
    GoAway {
        last_stream: u32,
        code: u32,
        debug: Vec<u8>,
    },
    WindowUpdate {
        stream: u32,
        increment: u32,
    },
    /// A frame that changes nothing for a client (PRIORITY, a type it does not know).
    Ignored,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Head,
    /// A frame other than DATA: its payload, read whole.
    Payload(Head),
    /// A padded DATA frame's pad length.
    PadLength(Head),
    /// A DATA frame's body, then `pad` bytes of padding.
    Data(Head, u8),
    Padding(Head, u8),
}

/// A header block being assembled across frames.
#[derive(Debug)]
struct Block {
    stream: u32,
    end_stream: bool,
    bytes: Vec<u8>,
}

/// Reads a connection's frames one piece at a time; see the module's docs.
#[derive(Debug)]
pub struct FrameReader {
    /// The largest frame the reader accepts (our SETTINGS_MAX_FRAME_SIZE).
    max_frame: u32,
    state: State,
    /// A header block whose END_HEADERS has not come yet: nothing but its CONTINUATION may come next.
    open: Option<Block>,
}

impl FrameReader {
    pub fn new(max_frame: u32) -> Self {
        FrameReader { max_frame: max_frame.clamp(DEFAULT_MAX_FRAME, MAX_FRAME_LIMIT), state: State::Head, open: None }
    }

    /// The largest frame accepted.
    pub fn max_frame(&self) -> u32 {
        self.max_frame
    }

    pub fn next(&self) -> Next {
        match self.state {
            State::Head => Next::Head,
            State::Payload(h) => Next::Payload(h.len as usize),
            State::PadLength(_) => Next::Payload(1),
            State::Data(h, pad) => {
                let len = h.len as usize - pad as usize - usize::from(h.has(flag::PADDED));
                Next::Data { stream: h.stream, len }
            }
            State::Padding(_, pad) => Next::Skip(pad as usize),
        }
    }

    /// Takes what [`FrameReader::next`] asked for ([`Next::Head`] or [`Next::Payload`]): the frame's
    /// meaning once it is whole.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Option<Event>, FrameError> {
        match self.state {
            State::Head => {
                let head: &[u8; HEADER_LEN] =
                    bytes.try_into().map_err(|_| FrameError::new(code::INTERNAL_ERROR, "a header is 9 bytes"))?;
                self.head(Head::parse(head))
            }
            State::Payload(h) => {
                if bytes.len() != h.len as usize {
                    return Err(FrameError::new(code::INTERNAL_ERROR, "fed a payload of the wrong length"));
                }
                self.state = State::Head;
                self.payload(h, bytes)
            }
            State::PadLength(h) => {
                let [pad] = bytes else {
                    return Err(FrameError::new(code::INTERNAL_ERROR, "a pad length is one byte"));
                };
                if *pad as u32 >= h.len {
                    return Err(FrameError::new(code::PROTOCOL_ERROR, "a DATA frame's padding is longer than it"));
                }
                self.state = State::Data(h, *pad);
                Ok(None)
            }
            State::Data(..) | State::Padding(..) => {
                Err(FrameError::new(code::INTERNAL_ERROR, "fed bytes where DATA or padding was asked for"))
            }
        }
    }

    /// The caller has taken a DATA frame's body ([`Next::Data`]).
    pub fn data_read(&mut self) -> Option<Event> {
        let State::Data(h, pad) = self.state else { return None };
        if pad > 0 {
            self.state = State::Padding(h, pad);
            return None;
        }
        self.state = State::Head;
        Some(data_end(h))
    }

    /// The caller has dropped the padding ([`Next::Skip`]).
    pub fn skipped(&mut self) -> Option<Event> {
        let State::Padding(h, _) = self.state else { return None };
        self.state = State::Head;
        Some(data_end(h))
    }

    fn head(&mut self, h: Head) -> Result<Option<Event>, FrameError> {
        let protocol = |what: &str| Err(FrameError::new(code::PROTOCOL_ERROR, what));
        let size = |what: &str| Err(FrameError::new(code::FRAME_SIZE_ERROR, what));
        if h.len > self.max_frame {
            return Err(FrameError::new(
                code::FRAME_SIZE_ERROR,
                format!("a frame of {} bytes, over the {} allowed", h.len, self.max_frame),
            ));
        }
        if let Some(open) = &self.open {
            if h.kind != kind::CONTINUATION || h.stream != open.stream {
                return protocol("a header block was interrupted by another frame");
            }
        }
        match h.kind {
            kind::DATA | kind::HEADERS | kind::PRIORITY | kind::RST_STREAM | kind::CONTINUATION if h.stream == 0 => {
                return protocol("a stream's frame on stream 0");
            }
            kind::SETTINGS | kind::PING | kind::GOAWAY if h.stream != 0 => {
                return protocol("a connection's frame on a stream");
            }
            kind::CONTINUATION if self.open.is_none() => return protocol("CONTINUATION with no header block open"),
            kind::PUSH_PROMISE => return protocol("PUSH_PROMISE, when push is disabled"),
            kind::PRIORITY if h.len != 5 => return size("PRIORITY is 5 bytes"),
            kind::RST_STREAM | kind::WINDOW_UPDATE if h.len != 4 => {
                return size("RST_STREAM and WINDOW_UPDATE are 4 bytes")
            }
            kind::SETTINGS if !h.len.is_multiple_of(6) || (h.has(flag::ACK) && h.len != 0) => {
                return size("SETTINGS of a length that is not whole settings");
            }
            kind::PING if h.len != 8 => return size("PING is 8 bytes"),
            kind::GOAWAY if h.len < 8 => return size("GOAWAY is at least 8 bytes"),
            kind::DATA => {
                if !h.has(flag::PADDED) {
                    self.state = State::Data(h, 0);
                } else if h.len == 0 {
                    return protocol("a padded DATA frame with no pad length");
                } else {
                    self.state = State::PadLength(h);
                }
                return Ok(None);
            }
            _ => {}
        }
        self.state = State::Payload(h);
        if h.len == 0 {
            self.state = State::Head;
            return self.payload(h, &[]);
        }
        Ok(None)
    }

    fn payload(&mut self, h: Head, p: &[u8]) -> Result<Option<Event>, FrameError> {
        let be32 = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        let event = match h.kind {
            kind::HEADERS => {
                let mut p = p;
                let mut pad = 0;
                if h.has(flag::PADDED) {
                    let Some((&n, rest)) = p.split_first() else {
                        return Err(FrameError::new(code::PROTOCOL_ERROR, "a padded HEADERS with no pad length"));
                    };
                    (pad, p) = (n as usize, rest);
                }
                if h.has(flag::PRIORITY) {
                    if p.len() < 5 {
                        return Err(FrameError::new(code::FRAME_SIZE_ERROR, "HEADERS too short for its priority"));
                    }
                    p = &p[5..];
                }
                if pad > p.len() {
                    return Err(FrameError::new(code::PROTOCOL_ERROR, "a HEADERS frame's padding is longer than it"));
                }
                let block =
                    Block { stream: h.stream, end_stream: h.has(flag::END_STREAM), bytes: p[..p.len() - pad].to_vec() };
                self.open = Some(block);
                return self.end_of_block(h);
            }
            kind::CONTINUATION => {
                let open = self.open.as_mut().expect("checked at the header");
                if open.bytes.len() + p.len() > MAX_HEADER_BLOCK {
                    return Err(FrameError::new(
                        code::PROTOCOL_ERROR,
                        format!("a header block over {MAX_HEADER_BLOCK} bytes"),
                    ));
                }
                open.bytes.extend_from_slice(p);
                return self.end_of_block(h);
            }
            kind::RST_STREAM => Event::Reset { stream: h.stream, code: be32(p) },
            kind::SETTINGS => {
                let values: Vec<(u16, u32)> =
                    p.chunks_exact(6).map(|s| (u16::from_be_bytes([s[0], s[1]]), be32(&s[2..]))).collect();
                for &(id, value) in &values {
                    let bad = match id {
                        setting::ENABLE_PUSH => (value > 1).then_some(code::PROTOCOL_ERROR),
                        setting::INITIAL_WINDOW_SIZE => (value > MAX_WINDOW).then_some(code::FLOW_CONTROL_ERROR),
                        setting::MAX_FRAME_SIZE => {
                            (!(DEFAULT_MAX_FRAME..=MAX_FRAME_LIMIT).contains(&value)).then_some(code::PROTOCOL_ERROR)
                        }
                        _ => None,
                    };
                    if let Some(code) = bad {
                        return Err(FrameError::new(code, format!("SETTINGS parameter {id} = {value}")));
                    }
                }
                Event::Settings { ack: h.has(flag::ACK), values }
            }
            kind::PING => Event::Ping { ack: h.has(flag::ACK), data: p.try_into().expect("checked at the header") },
            kind::GOAWAY => {
                Event::GoAway { last_stream: be32(p) & MAX_WINDOW, code: be32(&p[4..]), debug: p[8..].to_vec() }
            }
            kind::WINDOW_UPDATE => {
                let increment = be32(p) & MAX_WINDOW;
                if increment == 0 && h.stream == 0 {
                    return Err(FrameError::new(code::PROTOCOL_ERROR, "a connection WINDOW_UPDATE of 0"));
                }
                Event::WindowUpdate { stream: h.stream, increment }
            }
            _ => Event::Ignored,
        };
        Ok(Some(event))
    }

    fn end_of_block(&mut self, h: Head) -> Result<Option<Event>, FrameError> {
        let open = self.open.as_ref().expect("a block is open");
        if open.bytes.len() > MAX_HEADER_BLOCK {
            return Err(FrameError::new(code::PROTOCOL_ERROR, format!("a header block over {MAX_HEADER_BLOCK} bytes")));
        }
        if !h.has(flag::END_HEADERS) {
            return Ok(None);
        }
        let Block { stream, end_stream, bytes } = self.open.take().expect("a block is open");
        Ok(Some(Event::Headers { stream, block: bytes, end_stream }))
    }
}

fn data_end(h: Head) -> Event {
    Event::DataEnd { stream: h.stream, flow: h.len, end_stream: h.has(flag::END_STREAM) }
}

/// A frame: its header and payload.
pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Head { len: payload.len() as u32, kind, flags, stream }.encode().to_vec();
    out.extend_from_slice(payload);
    out
}

/// A SETTINGS frame of `values`.
pub fn settings(values: &[(u16, u32)]) -> Vec<u8> {
    let payload: Vec<u8> =
        values.iter().flat_map(|&(id, v)| id.to_be_bytes().into_iter().chain(v.to_be_bytes())).collect();
    frame(kind::SETTINGS, 0, 0, &payload)
}

pub fn settings_ack() -> Vec<u8> {
    frame(kind::SETTINGS, flag::ACK, 0, &[])
}

/// A PING asking for its ACK.
pub fn ping(data: [u8; 8]) -> Vec<u8> {
    frame(kind::PING, 0, 0, &data)
}

pub fn ping_ack(data: [u8; 8]) -> Vec<u8> {
    frame(kind::PING, flag::ACK, 0, &data)
}

pub fn window_update(stream: u32, increment: u32) -> Vec<u8> {
    frame(kind::WINDOW_UPDATE, 0, stream, &increment.to_be_bytes())
}

pub fn rst_stream(stream: u32, code: u32) -> Vec<u8> {
    frame(kind::RST_STREAM, 0, stream, &code.to_be_bytes())
}

pub fn goaway(last_stream: u32, code: u32) -> Vec<u8> {
    let mut p = last_stream.to_be_bytes().to_vec();
    p.extend_from_slice(&code.to_be_bytes());
    frame(kind::GOAWAY, 0, 0, &p)
}

/// A header block in HEADERS and, past `max_frame`, CONTINUATION frames.
pub fn headers(stream: u32, block: &[u8], max_frame: u32, end_stream: bool) -> Vec<u8> {
    let mut pieces = block.chunks(max_frame.max(1) as usize).peekable();
    let mut out = Vec::with_capacity(block.len() + HEADER_LEN);
    let mut first = true;
    if block.is_empty() {
        let flags = flag::END_HEADERS | if end_stream { flag::END_STREAM } else { 0 };
        return frame(kind::HEADERS, flags, stream, &[]);
    }
    while let Some(piece) = pieces.next() {
        let mut flags = if pieces.peek().is_none() { flag::END_HEADERS } else { 0 };
        let kind = if first { kind::HEADERS } else { kind::CONTINUATION };
        if first && end_stream {
            flags |= flag::END_STREAM;
        }
        out.extend_from_slice(&frame(kind, flags, stream, piece));
        first = false;
    }
    out
}

/// A DATA frame, with `pad` bytes of padding if given.
pub fn data(stream: u32, body: &[u8], pad: Option<u8>, end_stream: bool) -> Vec<u8> {
    let mut flags = if end_stream { flag::END_STREAM } else { 0 };
    let mut payload = Vec::with_capacity(body.len() + 256);
    if let Some(pad) = pad {
        flags |= flag::PADDED;
        payload.push(pad);
        payload.extend_from_slice(body);
        payload.resize(payload.len() + pad as usize, 0);
    } else {
        payload.extend_from_slice(body);
    }
    frame(kind::DATA, flags, stream, &payload)
}

/// A request's header block in HPACK, indexing nothing (the peer's table is never written, so no
/// table size it announces matters): `:method` GET, `:scheme`, `:authority`, `:path`, then `fields`
/// (lower-case names).
pub fn request_block(https: bool, authority: &str, path: &str, fields: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + path.len() + authority.len());
    // Indexed from the static table: `:method: GET` (2), `:scheme: http` (6) or `https` (7).
    out.push(0x80 | 2);
    out.push(0x80 | if https { 7 } else { 6 });
    // Literal without indexing, the name from the static table: `:authority` (1), `:path` (4).
    literal(&mut out, Some(1), "", authority);
    literal(&mut out, Some(4), "", path);
    for (name, value) in fields {
        literal(&mut out, None, name, value);
    }
    out
}

/// A literal field without indexing (RFC 7541 6.2.2), its name indexed or literal, no Huffman coding.
fn literal(out: &mut Vec<u8>, name_index: Option<u8>, name: &str, value: &str) {
    match name_index {
        Some(i) => integer(out, 0x00, 4, i as usize),
        None => {
            out.push(0x00);
            integer(out, 0x00, 7, name.len());
            out.extend_from_slice(name.as_bytes());
        }
    }
    integer(out, 0x00, 7, value.len());
    out.extend_from_slice(value.as_bytes());
}

/// An HPACK integer (RFC 7541 5.1) with an `n`-bit prefix after the bits `first`.
pub(crate) fn integer(out: &mut Vec<u8>, first: u8, n: u32, mut value: usize) {
    let max = (1usize << n) - 1;
    if value < max {
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    value -= max;
    while value >= 128 {
        out.push((value % 128) as u8 | 0x80);
        value /= 128;
    }
    out.push(value as u8);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A frame as the model sees it.
    #[derive(Debug, Clone)]
    enum Model {
        Data { stream: u32, body: Vec<u8>, pad: Option<u8>, end: bool },
        Headers { stream: u32, block: Vec<u8>, split: u32, end: bool },
        Ping([u8; 8]),
        Settings(Vec<(u16, u32)>),
        Window(u32, u32),
        Reset(u32, u32),
        Priority(u32),
        Unknown(u8, Vec<u8>),
    }

    fn model() -> impl Strategy<Value = Model> {
        let stream = 1u32..8;
        prop_oneof![
            (
                stream.clone(),
                proptest::collection::vec(any::<u8>(), 0..3000),
                proptest::option::of(any::<u8>()),
                any::<bool>()
            )
                .prop_map(|(stream, body, pad, end)| Model::Data { stream, body, pad, end }),
            (stream.clone(), proptest::collection::vec(any::<u8>(), 0..500), 1u32..200, any::<bool>())
                .prop_map(|(stream, block, split, end)| Model::Headers { stream, block, split, end }),
            any::<[u8; 8]>().prop_map(Model::Ping),
            proptest::collection::vec((7u16..100, any::<u32>()), 0..4).prop_map(Model::Settings),
            (0u32..8, 1u32..MAX_WINDOW).prop_map(|(s, i)| Model::Window(s, i)),
            (stream.clone(), any::<u32>()).prop_map(|(s, c)| Model::Reset(s, c)),
            stream.prop_map(Model::Priority),
            (10u8.., proptest::collection::vec(any::<u8>(), 0..100)).prop_map(|(k, p)| Model::Unknown(k, p)),
        ]
    }

    fn encode(m: &Model) -> Vec<u8> {
        match m {
            Model::Data { stream, body, pad, end } => data(*stream, body, *pad, *end),
            Model::Headers { stream, block, split, end } => headers(*stream, block, *split, *end),
            Model::Ping(d) => frame(kind::PING, 0, 0, d),
            Model::Settings(v) => settings(v),
            Model::Window(s, i) => window_update(*s, *i),
            Model::Reset(s, c) => rst_stream(*s, *c),
            Model::Priority(s) => frame(kind::PRIORITY, 0, *s, &[0, 0, 0, 0, 16]),
            Model::Unknown(k, p) => frame(*k, 0xff, 3, p),
        }
    }

    /// Each stream's DATA bytes.
    type Bodies = std::collections::BTreeMap<u32, Vec<u8>>;

    /// What the reader makes of `wire`, fed in pieces of at most `piece` bytes where it reads freely:
    /// each stream's DATA bytes, and the other events in order.
    fn read_all(wire: &[u8], piece: usize) -> Result<(Bodies, Vec<Event>), FrameError> {
        let mut r = FrameReader::new(DEFAULT_MAX_FRAME);
        let mut at = 0;
        let mut bodies = std::collections::BTreeMap::<u32, Vec<u8>>::new();
        let mut events = Vec::new();
        // An empty DATA frame at the wire's end is still the reader's to finish (`data_read`, no bytes).
        while at < wire.len() || matches!(r.next(), Next::Data { len: 0, .. }) {
            let event = match r.next() {
                Next::Head => {
                    let e = r.feed(&wire[at..at + HEADER_LEN])?;
                    at += HEADER_LEN;
                    e
                }
                Next::Payload(n) => {
                    let e = r.feed(&wire[at..at + n])?;
                    at += n;
                    e
                }
                Next::Data { stream, len } => {
                    // Read as a socket would give it: in pieces.
                    let body = bodies.entry(stream).or_default();
                    for chunk in wire[at..at + len].chunks(piece.max(1)) {
                        body.extend_from_slice(chunk);
                    }
                    at += len;
                    r.data_read()
                }
                Next::Skip(n) => {
                    at += n;
                    r.skipped()
                }
            };
            events.extend(event);
        }
        assert_eq!(r.next(), Next::Head, "the wire ended within a frame");
        Ok((bodies, events))
    }

    proptest! {
        /// Any sequence of valid frames reads back as the model wrote it: each stream's body byte for byte
        /// whatever its padding, each header block whole however it was split, every other frame's
        /// meaning, and what each DATA frame counts against the windows.
        #[test]
        fn frames_read_back_as_written(frames in proptest::collection::vec(model(), 0..40), piece in 1usize..5000) {
            let wire: Vec<u8> = frames.iter().flat_map(encode).collect();
            let (bodies, events) = read_all(&wire, piece).unwrap();
            let mut want_bodies = std::collections::BTreeMap::<u32, Vec<u8>>::new();
            let mut want = Vec::new();
            for m in &frames {
                match m {
                    Model::Data { stream, body, pad, end } => {
                        want_bodies.entry(*stream).or_default().extend_from_slice(body);
                        let flow = body.len() as u32 + pad.map_or(0, |p| p as u32 + 1);
                        want.push(Event::DataEnd { stream: *stream, flow, end_stream: *end });
                    }
                    Model::Headers { stream, block, end, .. } => {
                        want.push(Event::Headers { stream: *stream, block: block.clone(), end_stream: *end })
                    }
                    Model::Ping(d) => want.push(Event::Ping { ack: false, data: *d }),
                    Model::Settings(v) => want.push(Event::Settings { ack: false, values: v.clone() }),
                    Model::Window(s, i) => want.push(Event::WindowUpdate { stream: *s, increment: *i }),
                    Model::Reset(s, c) => want.push(Event::Reset { stream: *s, code: *c }),
                    Model::Priority(_) | Model::Unknown(..) => want.push(Event::Ignored),
                }
            }
            want_bodies.retain(|_, b| !b.is_empty());
            let mut bodies = bodies;
            bodies.retain(|_, b| !b.is_empty());
            prop_assert_eq!(bodies, want_bodies);
            prop_assert_eq!(events, want);
        }

        /// Arbitrary bytes never panic the reader, and it never asks for more than a frame holds.
        #[test]
        fn arbitrary_bytes_are_an_error_or_frames(wire in proptest::collection::vec(any::<u8>(), 0..2000)) {
            let mut r = FrameReader::new(DEFAULT_MAX_FRAME);
            let mut at = 0;
            loop {
                let step = match r.next() {
                    Next::Head => wire.get(at..at + HEADER_LEN).map(|b| (HEADER_LEN, r.feed(b))),
                    Next::Payload(n) => {
                        prop_assert!(n <= DEFAULT_MAX_FRAME as usize);
                        wire.get(at..at + n).map(|b| (n, r.feed(b)))
                    }
                    Next::Data { len, .. } => {
                        prop_assert!(len <= DEFAULT_MAX_FRAME as usize);
                        wire.get(at..at + len).map(|_| (len, Ok(r.data_read())))
                    }
                    Next::Skip(n) => wire.get(at..at + n).map(|_| (n, Ok(r.skipped()))),
                };
                match step {
                    None | Some((_, Err(_))) => break,
                    Some((n, Ok(_))) => at += n,
                }
            }
        }
    }

    fn read_err(wire: &[u8]) -> FrameError {
        read_all(wire, 1000).unwrap_err()
    }

    #[test]
    fn what_breaks_the_protocol_is_refused_with_its_code() {
        let cases: Vec<(Vec<u8>, u32)> = vec![
            (frame(kind::DATA, 0, 0, b"x"), code::PROTOCOL_ERROR),
            (frame(kind::DATA, flag::PADDED, 1, &[]), code::PROTOCOL_ERROR),
            (frame(kind::DATA, flag::PADDED, 1, &[3, 1, 2]), code::PROTOCOL_ERROR),
            (frame(kind::DATA, 0, 1, &vec![0; 16_385]), code::FRAME_SIZE_ERROR),
            (frame(kind::PUSH_PROMISE, flag::END_HEADERS, 1, &[0, 0, 0, 2]), code::PROTOCOL_ERROR),
            (frame(kind::PING, 0, 0, &[0; 7]), code::FRAME_SIZE_ERROR),
            (frame(kind::PING, 0, 1, &[0; 8]), code::PROTOCOL_ERROR),
            (frame(kind::SETTINGS, flag::ACK, 0, &[0; 6]), code::FRAME_SIZE_ERROR),
            (frame(kind::SETTINGS, 0, 0, &[0; 5]), code::FRAME_SIZE_ERROR),
            (settings(&[(setting::MAX_FRAME_SIZE, 100)]), code::PROTOCOL_ERROR),
            (settings(&[(setting::INITIAL_WINDOW_SIZE, 1 << 31)]), code::FLOW_CONTROL_ERROR),
            (settings(&[(setting::ENABLE_PUSH, 2)]), code::PROTOCOL_ERROR),
            (frame(kind::RST_STREAM, 0, 0, &[0; 4]), code::PROTOCOL_ERROR),
            (frame(kind::RST_STREAM, 0, 1, &[0; 5]), code::FRAME_SIZE_ERROR),
            (window_update(0, 0), code::PROTOCOL_ERROR),
            (frame(kind::GOAWAY, 0, 0, &[0; 7]), code::FRAME_SIZE_ERROR),
            (frame(kind::CONTINUATION, flag::END_HEADERS, 1, b"x"), code::PROTOCOL_ERROR),
            (frame(kind::HEADERS, flag::PADDED | flag::END_HEADERS, 1, &[5, 1, 2]), code::PROTOCOL_ERROR),
            (frame(kind::HEADERS, flag::PRIORITY | flag::END_HEADERS, 1, &[0; 4]), code::FRAME_SIZE_ERROR),
            // A header block interrupted by another frame, or by another stream's CONTINUATION.
            ([frame(kind::HEADERS, 0, 1, b"a"), settings(&[])].concat(), code::PROTOCOL_ERROR),
            (
                [frame(kind::HEADERS, 0, 1, b"a"), frame(kind::CONTINUATION, flag::END_HEADERS, 3, b"b")].concat(),
                code::PROTOCOL_ERROR,
            ),
        ];
        for (wire, want) in cases {
            let e = read_err(&wire);
            assert_eq!(e.code, want, "{wire:?}: {e}");
        }
        // Endless CONTINUATION frames are cut off at the bound, not held.
        let mut wire = frame(kind::HEADERS, 0, 1, &[0; 16_000]);
        for _ in 0..20 {
            wire.extend(frame(kind::CONTINUATION, 0, 1, &[0; 16_000]));
        }
        assert!(read_err(&wire).what.contains("header block over"));
    }

    #[test]
    fn integers_and_literals_are_hpacks() {
        // RFC 7541 C.1: 10 with a 5-bit prefix, 1337 with a 5-bit prefix, 42 with an 8-bit prefix.
        let enc = |n, v| {
            let mut out = Vec::new();
            integer(&mut out, 0, n, v);
            out
        };
        assert_eq!(enc(5, 10), [10]);
        assert_eq!(enc(5, 1337), [31, 154, 10]);
        assert_eq!(enc(8, 42), [42]);
        // RFC 7541 C.2.2: `:path: /sample/path`, literal without indexing, indexed name.
        let mut out = Vec::new();
        literal(&mut out, Some(4), "", "/sample/path");
        assert_eq!(out, b"\x04\x0c/sample/path");
        let block = request_block(false, "h:1", "/p", &[("range", "bytes=0-1")]);
        assert_eq!(&block[..2], [0x82, 0x86]);
    }
}
