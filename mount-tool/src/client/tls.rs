//! TLS for the mount's connections: rustls makes the handshake and keeps the session's secrets, and
//! the records after it are opened and sealed here, by `ring` (rustls's own provider), as rustls's
//! kernel-TLS interface ([`rustls::kernel`]) lets a connection do.
//!
//! Why: rustls decrypts each record in a buffer of its own and then copies the plaintext out, so a body
//! over TLS cost a receive, a decryption and two copies where h2c costs the receive alone (1.7-2.4x the
//! floor over TLS, docs/BENCHMARKS.md). Here a read that asks for a body's bytes ([`FAST_MIN`] or more)
//! has the socket's bytes received straight into the reader's memory (the buffer or the memory file the
//! body goes to) and every whole record among them opened where it lies, its plaintext written a few
//! bytes lower (AES-GCM and ChaCha20-Poly1305 decrypt from one place into a lower one in one pass), so
//! that the records' plaintexts end up side by side without their headers and tags: the receive and the
//! decryption, no copy. Smaller reads (frame heads, small frames) take records received into the
//! stream's own buffer ([`STAGING`]), opened in place and copied out.
//!
//! No byte reaches a reader before its record's tag is verified: a record that fails is an error, and
//! what the reader's memory held of it (ciphertext, tags) lies past the bytes the read reports.
//! TLS 1.3 (every suite rustls's `ring` provider offers) with its session tickets and key updates (the
//! server's, answered when it asks, and ours before a key's limit of records); TLS 1.2 with AES-GCM and
//! ChaCha20-Poly1305 (a connection ends at its key's limit: TLS 1.2 has no key update).

use ring::aead;
use rustls::client::{ClientConnectionData, UnbufferedClientConnection};
use rustls::kernel::KernelConnection;
use rustls::unbuffered::{ConnectionState, EncodeError, UnbufferedStatus};
use rustls::{ClientConfig, ConnectionTrafficSecrets, ProtocolVersion, SupportedCipherSuite};
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

/// A record's header: type, version, length.
const HEADER: usize = 5;
/// The most plaintext a record carries (RFC 8446 5.1).
const MAX_PLAIN: usize = 1 << 14;
/// The longest record body taken: TLS 1.2's bound, 2^14 + 2048 (RFC 5246 6.2.3; TLS 1.3's is smaller).
const MAX_BODY: usize = MAX_PLAIN + 2048;
/// The longest record, header and body.
const MAX_RECORD: usize = HEADER + MAX_BODY;
/// An AEAD tag.
const TAG: usize = 16;
/// Reads of at least this many bytes receive straight into the reader's memory: room for a partial
/// record staged and at least one whole record after it.
pub const FAST_MIN: usize = 2 * MAX_RECORD;
/// The stream's own buffer, for reads smaller than [`FAST_MIN`]: a partial record and up to 64 KiB
/// after it, received at once (small frames, a response's head and a small body, in one `recv`, as the
/// read-ahead under rustls did before).
pub const STAGING: usize = MAX_RECORD + (64 << 10);
/// Sealed bytes held for the socket before a write waits for it.
const WRITE_HIGH: usize = 64 << 10;
/// The most bytes a handshake's records may take before rustls has used them.
const HANDSHAKE_MAX: usize = 1 << 20;

const ALERT: u8 = 21;
const HANDSHAKE: u8 = 22;
const APPLICATION_DATA: u8 = 23;
/// Handshake message types after the handshake.
const NEW_SESSION_TICKET: u8 = 4;
const KEY_UPDATE: u8 = 24;
const HELLO_REQUEST: u8 = 0;

fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, HandshakeError(e))
}

/// What rustls refused in a handshake or a record (a certificate not trusted, among others), kept as its
/// own type inside the `io::Error` so that a caller can ask (`batchfs warm`'s hint about `ca_file`).
#[derive(Debug, thiserror::Error)]
#[error("TLS: {0}")]
pub struct HandshakeError(pub rustls::Error);

/// One direction's key, its fixed IV and the next record's sequence number.
struct Direction {
    key: aead::LessSafeKey,
    iv: [u8; aead::NONCE_LEN],
    seq: u64,
}

impl Direction {
    fn new(secrets: ConnectionTrafficSecrets, seq: u64) -> io::Result<Self> {
        let (algorithm, key, iv) = match secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&aead::AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&aead::AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (&aead::CHACHA20_POLY1305, key, iv),
            _ => return Err(io::Error::new(io::ErrorKind::Unsupported, "TLS: a cipher suite this mount cannot use")),
        };
        let key = aead::UnboundKey::new(algorithm, key.as_ref())
            .map_err(|_| invalid("TLS: a traffic key of the wrong length".into()))?;
        let iv = iv.as_ref().try_into().map_err(|_| invalid("TLS: an IV of the wrong length".into()))?;
        Ok(Direction { key: aead::LessSafeKey::new(key), iv, seq })
    }

    /// The IV with the sequence number folded into its last 8 bytes (TLS 1.3, and TLS 1.2's
    /// ChaCha20-Poly1305 and, as rustls sends them, its AES-GCM explicit nonces).
    fn nonce(&self) -> [u8; aead::NONCE_LEN] {
        let mut nonce = self.iv;
        for (n, s) in nonce[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *n ^= s;
        }
        nonce
    }
}

/// How records are framed: TLS 1.3, or TLS 1.2 with or without an explicit nonce in each record.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Framing {
    Tls13,
    Tls12 { explicit: bool },
}

/// How records are framed, and the keys both ways.
struct Keys {
    framing: Framing,
    rx: Direction,
    tx: Direction,
}

/// The records' keys, and rustls's side of the session (tickets, key updates).
struct Records {
    keys: Keys,
    /// Records sealed under one key at most.
    tx_limit: u64,
    /// TLS 1.3: our key was updated and no record sealed under it since (a KeyUpdate the server asks for
    /// then is answered already: it must come before our next record, and it does).
    tx_fresh: bool,
    session: KernelConnection<ClientConnectionData>,
}

/// The length of the record at the start of `buf` if it is whole there.
fn whole_record(buf: &[u8]) -> io::Result<Option<usize>> {
    if buf.len() < HEADER {
        return Ok(None);
    }
    let len = u16::from_be_bytes([buf[3], buf[4]]) as usize;
    if len > MAX_BODY {
        return Err(invalid(format!("TLS: a record of {len} bytes, past the {MAX_BODY} allowed")));
    }
    Ok((buf.len() >= HEADER + len).then_some(len))
}

impl Keys {
    /// Opens the whole record at `buf[at..]`, its plaintext written to `buf[to..]` (`to <= at`): its
    /// content type and the plaintext's length. Fails, writing nothing a reader is shown, when its tag
    /// does not verify.
    fn open(&mut self, buf: &mut [u8], at: usize, to: usize) -> io::Result<(u8, usize)> {
        debug_assert!(to <= at);
        let head: [u8; HEADER] = buf[at..at + HEADER].try_into().expect("a header");
        let (outer, len) = (head[0], u16::from_be_bytes([head[3], head[4]]) as usize);
        let end = at + HEADER + len;
        let failed = || invalid("TLS: a record that failed its authentication (bad_record_mac)".into());
        let rx = &mut self.rx;
        let opened = match self.framing {
            Framing::Tls13 => {
                if outer != APPLICATION_DATA {
                    return Err(invalid(format!("TLS: a TLS 1.3 record of type {outer} after the handshake")));
                }
                if len < TAG + 1 {
                    return Err(invalid(format!("TLS: a record of {len} bytes, shorter than its tag")));
                }
                let nonce = aead::Nonce::assume_unique_for_key(rx.nonce());
                let plain = rx
                    .key
                    .open_within(nonce, aead::Aad::from(head), &mut buf[to..end], at + HEADER - to..)
                    .map_err(|_| failed())?;
                // TLS 1.3 hides the type at the plaintext's end, after it any zeros of padding.
                let Some(last) = plain.iter().rposition(|&b| b != 0) else {
                    return Err(invalid("TLS: a record with no content type".into()));
                };
                (plain[last], last)
            }
            Framing::Tls12 { explicit } => {
                let skip = if explicit { 8 } else { 0 };
                let Some(plain_len) = len.checked_sub(skip + TAG) else {
                    return Err(invalid(format!("TLS: a record of {len} bytes, shorter than its nonce and tag")));
                };
                let nonce = if explicit {
                    let mut nonce = [0; aead::NONCE_LEN];
                    nonce[..4].copy_from_slice(&rx.iv[..4]);
                    nonce[4..].copy_from_slice(&buf[at + HEADER..at + HEADER + 8]);
                    nonce
                } else {
                    rx.nonce()
                };
                let mut aad = [0; 13];
                aad[..8].copy_from_slice(&rx.seq.to_be_bytes());
                aad[8..11].copy_from_slice(&head[..3]);
                aad[11..].copy_from_slice(&(plain_len as u16).to_be_bytes());
                let nonce = aead::Nonce::assume_unique_for_key(nonce);
                let src = at + HEADER + skip - to..;
                rx.key.open_within(nonce, aead::Aad::from(aad), &mut buf[to..end], src).map_err(|_| failed())?;
                (outer, plain_len)
            }
        };
        rx.seq += 1;
        Ok(opened)
    }

    /// Seals `plain` (at most [`MAX_PLAIN`] bytes) of content `kind` as one record at the end of `out`.
    fn seal(&mut self, kind: u8, plain: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        let tx = &mut self.tx;
        let at = out.len();
        let sealed = match self.framing {
            Framing::Tls13 => {
                let len = plain.len() + 1 + TAG;
                out.extend_from_slice(&[APPLICATION_DATA, 3, 3, (len >> 8) as u8, len as u8]);
                out.extend_from_slice(plain);
                out.push(kind);
                let head: [u8; HEADER] = out[at..at + HEADER].try_into().expect("a header");
                let nonce = aead::Nonce::assume_unique_for_key(tx.nonce());
                tx.key.seal_in_place_separate_tag(nonce, aead::Aad::from(head), &mut out[at + HEADER..])
            }
            Framing::Tls12 { explicit } => {
                let nonce = tx.nonce();
                let len = if explicit { 8 } else { 0 } + plain.len() + TAG;
                out.extend_from_slice(&[kind, 3, 3, (len >> 8) as u8, len as u8]);
                if explicit {
                    out.extend_from_slice(&nonce[4..]);
                }
                let start = out.len();
                out.extend_from_slice(plain);
                let mut aad = [0; 13];
                aad[..8].copy_from_slice(&tx.seq.to_be_bytes());
                aad[8..11].copy_from_slice(&[kind, 3, 3]);
                aad[11..].copy_from_slice(&(plain.len() as u16).to_be_bytes());
                let nonce = aead::Nonce::assume_unique_for_key(nonce);
                tx.key.seal_in_place_separate_tag(nonce, aead::Aad::from(aad), &mut out[start..])
            }
        };
        let tag = sealed.map_err(|_| invalid("TLS: a record could not be sealed".into()))?;
        out.extend_from_slice(tag.as_ref());
        tx.seq += 1;
        Ok(())
    }
}

impl Records {
    /// Seals `plain` (at most [`MAX_PLAIN`] bytes) of content `kind` as one record at the end of `out`,
    /// the key updated first where it reached its limit of records.
    fn seal(&mut self, kind: u8, plain: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        if self.keys.tx.seq >= self.tx_limit {
            match self.keys.framing {
                Framing::Tls13 => self.update_tx(out)?,
                Framing::Tls12 { .. } => {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "TLS: the connection sealed as many records as its key may (TLS 1.2 has no key update)",
                    ))
                }
            }
        }
        self.tx_fresh = false;
        self.keys.seal(kind, plain, out)
    }

    /// TLS 1.3: tells the server our next records use a new key (a KeyUpdate that asks for none back),
    /// and takes it.
    fn update_tx(&mut self, out: &mut Vec<u8>) -> io::Result<()> {
        self.keys.seal(HANDSHAKE, &[KEY_UPDATE, 0, 0, 1, 0], out)?;
        let (seq, secrets) = self.session.update_tx_secret().map_err(tls_error)?;
        self.keys.tx = Direction::new(secrets, seq)?;
        self.tx_fresh = true;
        Ok(())
    }
}

/// A TLS client connection to a server, its records sealed and opened by [`Records`]; see the module's
/// docs.
pub struct TlsStream {
    tcp: TcpStream,
    records: Records,
    /// The protocol ALPN agreed on.
    alpn: Option<Vec<u8>>,
    /// Received bytes of records not yet opened (`start..end`), and before `start` the plaintext of the
    /// last record opened here not yet read (`plain`).
    staging: Box<[u8]>,
    start: usize,
    end: usize,
    plain: std::ops::Range<usize>,
    /// Plaintext rustls opened during the handshake, read first.
    early: Vec<u8>,
    early_read: usize,
    /// A handshake message arriving in pieces (TLS 1.3 allows one to span records).
    handshake: Vec<u8>,
    /// The server's close_notify came: nothing more is read.
    closed: bool,
    /// Sealed records for the socket, from `sent` on.
    out: Vec<u8>,
    sent: usize,
    close_sent: bool,
}

/// Makes the TLS handshake over `tcp` with rustls (`config` must allow secret extraction), then leaves
/// the records to the [`TlsStream`].
pub async fn handshake(
    mut tcp: TcpStream,
    config: Arc<ClientConfig>,
    name: rustls::pki_types::ServerName<'static>,
) -> io::Result<TlsStream> {
    let mut conn = UnbufferedClientConnection::new(config, name).map_err(tls_error)?;
    let mut incoming = vec![0u8; STAGING];
    let mut filled = 0;
    let mut outgoing = Vec::new();
    let mut early = Vec::new();
    let mut closed = false;
    loop {
        let UnbufferedStatus { discard, state } = conn.process_tls_records(&mut incoming[..filled]);
        let (mut read_more, mut done) = (false, false);
        match state.map_err(tls_error)? {
            ConnectionState::EncodeTlsData(mut data) => {
                let mut chunk = vec![0; 4096];
                let n = match data.encode(&mut chunk) {
                    Err(EncodeError::InsufficientSize(e)) => {
                        chunk.resize(e.required_size, 0);
                        data.encode(&mut chunk)
                    }
                    other => other,
                }
                .map_err(|e| invalid(format!("TLS: {e}")))?;
                outgoing.extend_from_slice(&chunk[..n]);
            }
            ConnectionState::TransmitTlsData(data) => {
                tcp.write_all(&outgoing).await?;
                outgoing.clear();
                data.done();
            }
            ConnectionState::BlockedHandshake => read_more = true,
            ConnectionState::ReadTraffic(mut traffic) => {
                while let Some(record) = traffic.next_record() {
                    early.extend_from_slice(record.map_err(tls_error)?.payload);
                }
            }
            ConnectionState::WriteTraffic(_) => done = true,
            ConnectionState::PeerClosed | ConnectionState::Closed => closed = true,
            other => return Err(invalid(format!("TLS: unexpected in a handshake: {other:?}"))),
        }
        incoming.copy_within(discard..filled, 0);
        filled -= discard;
        if closed {
            // The server's close_notify right after the handshake is a stream at its end; before, a failure.
            if conn.is_handshaking() {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the server closed TLS in its handshake"));
            }
            break;
        }
        if done {
            break;
        }
        if read_more {
            if filled == incoming.len() {
                if incoming.len() >= HANDSHAKE_MAX {
                    return Err(invalid(format!("TLS: a handshake past {HANDSHAKE_MAX} bytes")));
                }
                incoming.resize(incoming.len() * 2, 0);
            }
            let n = tcp.read(&mut incoming[filled..]).await?;
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the server closed TLS in its handshake"));
            }
            filled += n;
        }
    }
    let alpn = conn.alpn_protocol().map(<[u8]>::to_vec);
    let (secrets, session) = conn.dangerous_into_kernel_connection().map_err(tls_error)?;
    let framing = match session.protocol_version() {
        ProtocolVersion::TLSv1_3 => Framing::Tls13,
        _ => Framing::Tls12 { explicit: !matches!(secrets.rx.1, ConnectionTrafficSecrets::Chacha20Poly1305 { .. }) },
    };
    let tx_limit = match session.negotiated_cipher_suite() {
        SupportedCipherSuite::Tls13(suite) => suite.common.confidentiality_limit,
        SupportedCipherSuite::Tls12(suite) => suite.common.confidentiality_limit,
    };
    let records = Records {
        keys: Keys {
            framing,
            rx: Direction::new(secrets.rx.1, secrets.rx.0)?,
            tx: Direction::new(secrets.tx.1, secrets.tx.0)?,
        },
        // Some room before the limit, as rustls leaves.
        tx_limit: tx_limit.saturating_sub(1 << 10),
        tx_fresh: false,
        session,
    };
    // What follows the handshake's last whole record is part of a record at most.
    debug_assert!(filled < MAX_RECORD);
    let mut staging = vec![0; STAGING.max(filled)].into_boxed_slice();
    staging[..filled].copy_from_slice(&incoming[..filled]);
    Ok(TlsStream {
        tcp,
        records,
        alpn,
        staging,
        start: 0,
        end: filled,
        plain: 0..0,
        early,
        early_read: 0,
        handshake: Vec::new(),
        closed,
        out: Vec::new(),
        sent: 0,
        close_sent: false,
    })
}

impl TlsStream {
    /// The protocol ALPN agreed on, if any.
    pub fn alpn_protocol(&self) -> Option<&[u8]> {
        self.alpn.as_deref()
    }

    /// What a record of content `kind` other than application data says (`message`, its plaintext).
    fn control(&mut self, kind: u8, message: &[u8]) -> io::Result<()> {
        match kind {
            ALERT => {
                let &[level, description] = message else {
                    return Err(invalid(format!("TLS: an alert of {} bytes", message.len())));
                };
                if description == 0 {
                    self.closed = true;
                    Ok(())
                } else if level == 1 && self.records.keys.framing != Framing::Tls13 {
                    tracing::debug!(description, "a TLS warning alert from the server, ignored");
                    Ok(())
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        format!("TLS: the server sent alert {description}"),
                    ))
                }
            }
            HANDSHAKE => {
                self.handshake.extend_from_slice(message);
                self.handshake_messages()
            }
            _ => Err(invalid(format!("TLS: a record of content type {kind} after the handshake"))),
        }
    }

    /// The whole handshake messages received: session tickets kept, key updates taken (and answered
    /// where the server asks), TLS 1.2's HelloRequest ignored (we do not renegotiate).
    fn handshake_messages(&mut self) -> io::Result<()> {
        let mut used = 0;
        while let [kind, a, b, c, ..] = self.handshake[used..] {
            let len = u32::from_be_bytes([0, a, b, c]) as usize;
            let Some(body) = self.handshake.get(used + 4..used + 4 + len) else { break };
            match (self.records.keys.framing, kind) {
                (Framing::Tls13, NEW_SESSION_TICKET) => {
                    self.records.session.handle_new_session_ticket(body).map_err(tls_error)?;
                }
                (Framing::Tls13, KEY_UPDATE) => {
                    let &[requested] = body else { return Err(invalid("TLS: a malformed KeyUpdate".into())) };
                    let (seq, secrets) = self.records.session.update_rx_secret().map_err(tls_error)?;
                    self.records.keys.rx = Direction::new(secrets, seq)?;
                    // Answered once before our next record (RFC 8446, 4.6.3): a server asking again and again
                    // while it reads nothing (each answer queued in `out`, sent only by a write) gets one.
                    if requested == 1 && !self.records.tx_fresh {
                        self.records.update_tx(&mut self.out)?;
                    }
                }
                (Framing::Tls12 { .. }, HELLO_REQUEST) => {}
                _ => return Err(invalid(format!("TLS: handshake message {kind} after the handshake"))),
            }
            used += 4 + len;
        }
        self.handshake.drain(..used);
        if self.handshake.len() > MAX_BODY {
            return Err(invalid("TLS: a handshake message past a record's size after the handshake".into()));
        }
        Ok(())
    }

    /// The socket ended: the end of the stream where no record was cut short.
    fn ended(&mut self) -> io::Result<()> {
        if self.end > self.start {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the connection ended inside a TLS record"));
        }
        self.closed = true;
        Ok(())
    }

    /// Receives into `out` and opens every whole record there, their plaintexts side by side from
    /// `out`'s first unfilled byte: how many bytes of plaintext it gave (0 when what came held no whole
    /// record of application data). A partial record staged goes in front of what comes, and the part
    /// of a record at the end goes back into staging.
    fn poll_direct(&mut self, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<usize>> {
        let staged = self.end - self.start;
        debug_assert!(self.plain.is_empty() && staged < MAX_RECORD && out.remaining() >= FAST_MIN);
        let filled = out.filled().len();
        // SAFETY: bytes are only written into `room`, never de-initialized; `assume_init` below covers
        // exactly the bytes the receive and the copy wrote.
        let room = unsafe { out.unfilled_mut() };
        let mut recv = ReadBuf::uninit(&mut room[staged..]);
        ready!(Pin::new(&mut self.tcp).poll_read(cx, &mut recv))?;
        let got = recv.filled().len();
        if got == 0 {
            self.ended()?;
            return Poll::Ready(Ok(0));
        }
        // SAFETY: `room` has at least `staged` bytes (FAST_MIN > MAX_RECORD), and staging's bytes do not
        // overlap the reader's memory.
        unsafe {
            std::ptr::copy_nonoverlapping(self.staging[self.start..].as_ptr(), room.as_mut_ptr().cast::<u8>(), staged);
        }
        (self.start, self.end) = (0, 0);
        // SAFETY: the copy wrote the first `staged` bytes and the receive the `got` after them.
        unsafe { out.assume_init(staged + got) };
        let region = &mut out.initialized_mut()[filled..filled + staged + got];
        let (mut at, mut to) = (0, 0);
        while let Some(len) = whole_record(&region[at..])? {
            let (kind, n) = self.records.keys.open(region, at, to)?;
            at += HEADER + len;
            if kind == APPLICATION_DATA {
                to += n;
            } else {
                let message = region[to..to + n].to_vec();
                self.control(kind, &message)?;
            }
            if self.closed {
                at = region.len();
            }
        }
        let tail = &region[at..];
        self.staging[..tail.len()].copy_from_slice(tail);
        self.end = tail.len();
        out.set_filled(filled + to);
        Poll::Ready(Ok(to))
    }

    /// Receives into staging, after the partial record there (moved to its start; no plaintext is left
    /// unread before it).
    fn poll_stage(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.start > 0 {
            self.staging.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        let mut recv = ReadBuf::new(&mut self.staging[self.end..]);
        ready!(Pin::new(&mut self.tcp).poll_read(cx, &mut recv))?;
        let got = recv.filled().len();
        if got == 0 {
            return Poll::Ready(self.ended());
        }
        self.end += got;
        Poll::Ready(Ok(()))
    }

    /// Sends what is sealed.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.out.len() {
            let n = ready!(Pin::new(&mut self.tcp).poll_write(cx, &self.out[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.out.clear();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for TlsStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // Bytes were given: the read ends before it would wait for the socket.
        let mut served = false;
        loop {
            if this.early_read < this.early.len() {
                let n = out.remaining().min(this.early.len() - this.early_read);
                out.put_slice(&this.early[this.early_read..this.early_read + n]);
                this.early_read += n;
                if this.early_read == this.early.len() {
                    (this.early, this.early_read) = (Vec::new(), 0);
                }
                served = true;
            }
            if !this.plain.is_empty() {
                let n = out.remaining().min(this.plain.len());
                out.put_slice(&this.staging[this.plain.start..this.plain.start + n]);
                this.plain.start += n;
                served = true;
            }
            if this.closed || out.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            if let Some(len) = whole_record(&this.staging[this.start..this.end])? {
                // Opened where it lies, its plaintext where its header was.
                let at = this.start;
                let (kind, n) = this.records.keys.open(&mut this.staging, at, at)?;
                this.start = at + HEADER + len;
                if kind == APPLICATION_DATA {
                    this.plain = at..at + n;
                } else {
                    let message = this.staging[at..at + n].to_vec();
                    this.control(kind, &message)?;
                }
                continue;
            }
            if served {
                return Poll::Ready(Ok(()));
            }
            if out.remaining() >= FAST_MIN {
                if ready!(this.poll_direct(cx, out))? > 0 {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            ready!(this.poll_stage(cx))?;
        }
    }
}

impl AsyncWrite for TlsStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.out.len() - this.sent >= WRITE_HIGH {
            ready!(this.poll_send(cx))?;
        }
        if this.close_sent {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        let n = buf.len().min(WRITE_HIGH);
        for piece in buf[..n].chunks(MAX_PLAIN) {
            this.records.seal(APPLICATION_DATA, piece, &mut this.out)?;
        }
        // Sent now if the socket takes it, else by the next write or flush.
        if let Poll::Ready(Err(e)) = this.poll_send(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.close_sent {
            // A warning-level close_notify.
            this.records.keys.seal(ALERT, &[1, 0], &mut this.out)?;
            this.close_sent = true;
        }
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rustls::crypto::ring::cipher_suite;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use std::io::{Read, Write};

    /// A certificate for `localhost` and its key.
    fn certificate() -> (CertificateDer<'static>, PrivateKeyDer<'static>) {
        let made = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        (made.cert.der().clone(), PrivateKeyDer::Pkcs8(made.signing_key.serialize_der().into()))
    }

    /// What the test's rustls server does once the handshake is made.
    #[derive(Clone, Default)]
    struct Script {
        /// Sent to the client, in writes of 70,001 bytes.
        send: Vec<u8>,
        /// A key update (asking for the client's) after this many writes.
        key_update_after: Option<usize>,
        /// Records of at most this many bytes (rustls's `max_fragment_size`).
        fragment: Option<usize>,
        /// Bytes then read from the client, returned by the server's thread.
        take_back: usize,
        /// Key updates asking for ours sent after `send`, one after another, then a byte.
        key_updates: usize,
    }

    /// A rustls server of one connection on `listener`, one cipher suite, following `script`.
    fn server(
        listener: std::net::TcpListener,
        suite: SupportedCipherSuite,
        (cert, key): (CertificateDer<'static>, PrivateKeyDer<'static>),
        script: Script,
    ) -> std::thread::JoinHandle<Vec<u8>> {
        let mut provider = rustls::crypto::ring::default_provider();
        provider.cipher_suites = vec![suite];
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(provider))
            .with_protocol_versions(&[suite.version()])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert], key)
            .unwrap();
        config.alpn_protocols = vec![b"h2".to_vec()];
        config.max_fragment_size = script.fragment;
        std::thread::spawn(move || {
            let (mut socket, _) = listener.accept().unwrap();
            let mut conn = rustls::ServerConnection::new(Arc::new(config)).unwrap();
            let mut tls = rustls::Stream::new(&mut conn, &mut socket);
            for (i, piece) in script.send.chunks(70_001).enumerate() {
                tls.write_all(piece).unwrap();
                if script.key_update_after == Some(i) {
                    tls.conn.refresh_traffic_keys().unwrap();
                }
            }
            if script.key_updates > 0 {
                for _ in 0..script.key_updates {
                    tls.conn.refresh_traffic_keys().unwrap();
                }
                tls.write_all(&[0xee]).unwrap();
            }
            tls.flush().unwrap();
            let mut back = vec![0; script.take_back];
            tls.read_exact(&mut back).unwrap();
            conn.send_close_notify();
            conn.complete_io(&mut socket).unwrap();
            back
        })
    }

    /// A client's stream to `addr`, trusting `cert`.
    async fn client(addr: std::net::SocketAddr, cert: CertificateDer<'static>) -> io::Result<TlsStream> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec()];
        config.enable_secret_extraction = true;
        let tcp = TcpStream::connect(addr).await?;
        handshake(tcp, Arc::new(config), ServerName::try_from("localhost").unwrap()).await
    }

    /// Reads until the end, in reads of `sizes` in turn (some into uninitialized memory): every byte,
    /// or the bytes before an error and the error.
    async fn read_all(stream: &mut TlsStream, sizes: &[usize]) -> (Vec<u8>, io::Result<()>) {
        let mut got = Vec::new();
        for k in 0.. {
            let size = sizes[k % sizes.len()];
            let n = if k % 2 == 0 {
                let mut buf = vec![0; size];
                let n = match stream.read(&mut buf).await {
                    Ok(n) => n,
                    Err(e) => return (got, Err(e)),
                };
                got.extend_from_slice(&buf[..n]);
                n
            } else {
                let mut buf = bytes::BytesMut::with_capacity(size);
                let n = match (&mut *stream).take(size as u64).read_buf(&mut buf).await {
                    Ok(n) => n,
                    Err(e) => return (got, Err(e)),
                };
                got.extend_from_slice(&buf);
                n
            };
            if n == 0 {
                break;
            }
        }
        (got, Ok(()))
    }

    fn pattern(len: usize, seed: u32) -> Vec<u8> {
        (0..len as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8).collect()
    }

    const SIZES: [usize; 8] = [1, 9, 4096, 16_709, FAST_MIN, FAST_MIN + 1, 1 << 20, 100_000];

    /// Every suite of TLS 1.3 and TLS 1.2 the mount offers, records whole and cut small: every byte the
    /// server sends read in order whatever the reads' sizes, what the client writes read by the server,
    /// and the server's close_notify the end of the stream.
    #[tokio::test]
    async fn every_suite_carries_every_byte_both_ways() {
        let suites = [
            cipher_suite::TLS13_AES_256_GCM_SHA384,
            cipher_suite::TLS13_AES_128_GCM_SHA256,
            cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
            cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
            cipher_suite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
        ];
        for suite in suites {
            for fragment in [None, Some(777)] {
                let cert = certificate();
                let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                let addr = listener.local_addr().unwrap();
                let send = pattern(3_000_000, 7);
                let script = Script { send: send.clone(), fragment, take_back: 200_000, ..Script::default() };
                let served = server(listener, suite, (cert.0.clone(), cert.1.clone_key()), script);
                let mut stream = client(addr, cert.0).await.unwrap();
                let back = pattern(200_000, 11);
                stream.write_all(&back).await.unwrap();
                stream.flush().await.unwrap();
                let (got, end) = read_all(&mut stream, &SIZES).await;
                end.unwrap();
                assert_eq!(got.len(), send.len(), "{suite:?} {fragment:?}");
                assert!(got == send, "{suite:?} {fragment:?}: the bytes differ");
                assert!(stream.closed, "{suite:?}: the end came with the server's close_notify");
                assert!(tokio::task::spawn_blocking(move || served.join().unwrap()).await.unwrap() == back);
            }
        }
    }

    /// TLS 1.3 key updates: the server's, asking for ours, in the middle of what it sends (what it sends
    /// after, under its new key, read whole; what we send after, under ours, read by it), and ours, as a
    /// key nears its limit of records.
    #[tokio::test]
    async fn key_updates_both_ways_keep_every_byte() {
        let cert = certificate();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let send = pattern(2_000_000, 3);
        let script = Script { send: send.clone(), key_update_after: Some(10), take_back: 600_000, ..Script::default() };
        let served =
            server(listener, cipher_suite::TLS13_AES_256_GCM_SHA384, (cert.0.clone(), cert.1.clone_key()), script);
        let mut stream = client(addr, cert.0).await.unwrap();
        // Our own key update every 5 records.
        stream.records.tx_limit = 5;
        let back = pattern(600_000, 5);
        let mut got = vec![0; send.len()];
        stream.read_exact(&mut got).await.unwrap();
        assert!(got == send, "the bytes differ");
        // Records counted from the server's new key: fewer than the 2 MB's 123.
        assert!(stream.records.keys.rx.seq < 100, "{} records under one key", stream.records.keys.rx.seq);
        for piece in back.chunks(30_000) {
            stream.write_all(piece).await.unwrap();
        }
        stream.flush().await.unwrap();
        assert!(stream.records.keys.tx.seq <= 5, "{} records under one key", stream.records.keys.tx.seq);
        let (rest, end) = read_all(&mut stream, &SIZES).await;
        end.unwrap();
        assert!(rest.is_empty() && stream.closed);
        assert!(tokio::task::spawn_blocking(move || served.join().unwrap()).await.unwrap() == back);
    }

    /// A server asking for our key's update again and again, reading nothing (our answers, queued until we
    /// write, took 27 bytes each without end), gets one answer before our next record, and reads it.
    #[tokio::test]
    async fn key_updates_asked_for_again_and_again_are_answered_once() {
        let cert = certificate();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let send = pattern(100_000, 9);
        let script = Script { send: send.clone(), key_updates: 2000, take_back: 50_000, ..Script::default() };
        let served =
            server(listener, cipher_suite::TLS13_AES_128_GCM_SHA256, (cert.0.clone(), cert.1.clone_key()), script);
        let mut stream = client(addr, cert.0).await.unwrap();
        let mut got = vec![0; send.len() + 1];
        stream.read_exact(&mut got).await.unwrap();
        assert!(got[..send.len()] == send && got[send.len()] == 0xee, "the bytes differ");
        let queued = stream.out.len() - stream.sent;
        assert!(queued < 100, "{queued} bytes of answers queued for 2000 key updates");
        let back = pattern(50_000, 4);
        stream.write_all(&back).await.unwrap();
        stream.flush().await.unwrap();
        let (rest, end) = read_all(&mut stream, &SIZES).await;
        end.unwrap();
        assert!(rest.is_empty() && stream.closed);
        assert!(tokio::task::spawn_blocking(move || served.join().unwrap()).await.unwrap() == back);
    }

    /// A byte changed on the way, past the handshake: the read fails at that record, and every byte it
    /// gave before is the server's.
    #[tokio::test]
    async fn a_changed_byte_is_an_error_never_a_wrong_byte() {
        for (suite, at) in [
            (cipher_suite::TLS13_AES_128_GCM_SHA256, 1_000_003),
            (cipher_suite::TLS13_CHACHA20_POLY1305_SHA256, 77_777),
            (cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384, 500_000),
        ] {
            let cert = certificate();
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let server_addr = listener.local_addr().unwrap();
            let send = pattern(2_000_000, 9);
            let served = server(
                listener,
                suite,
                (cert.0.clone(), cert.1.clone_key()),
                Script { send: send.clone(), ..Script::default() },
            );
            // A relay that flips one bit of the server's `at`th byte.
            let relay = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = relay.local_addr().unwrap();
            std::thread::spawn(move || {
                let (client, _) = relay.accept().unwrap();
                let upstream = std::net::TcpStream::connect(server_addr).unwrap();
                let (mut c2, mut u2) = (client.try_clone().unwrap(), upstream.try_clone().unwrap());
                std::thread::spawn(move || std::io::copy(&mut c2, &mut u2));
                let (mut from, mut to, mut seen) = (upstream, client, 0usize);
                let mut buf = vec![0; 65_536];
                loop {
                    let n = match from.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if (seen..seen + n).contains(&at) {
                        buf[at - seen] ^= 0x20;
                    }
                    seen += n;
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
            let mut stream = client(addr, cert.0).await.unwrap();
            let (got, end) = read_all(&mut stream, &SIZES).await;
            let e = end.expect_err("the changed record is refused");
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{suite:?}: {e}");
            assert!(e.to_string().contains("bad_record_mac"), "{e}");
            assert!(got.len() < at && got == send[..got.len()], "{suite:?}: {} bytes, not the server's", got.len());
            drop(stream);
            let _ = tokio::task::spawn_blocking(move || served.join()).await;
        }
    }

    /// A record's header is read before anything authenticates it: a length past the largest record is
    /// refused at once, and a record is whole only with all its bytes.
    #[test]
    fn a_record_is_whole_only_with_all_its_bytes_and_never_longer_than_allowed() {
        let head = |len: usize| vec![APPLICATION_DATA, 3, 3, (len >> 8) as u8, len as u8];
        assert_eq!(whole_record(&head(100)[..4]).unwrap(), None);
        assert_eq!(whole_record(&head(100)).unwrap(), None);
        let mut record = head(100);
        record.resize(HEADER + 100, 7);
        assert_eq!(whole_record(&record).unwrap(), Some(100));
        record.push(0);
        assert_eq!(whole_record(&record).unwrap(), Some(100));
        assert_eq!(whole_record(&head(MAX_BODY)).unwrap(), None);
        let e = whole_record(&head(MAX_BODY + 1)).unwrap_err();
        assert!(e.kind() == io::ErrorKind::InvalidData && e.to_string().contains("past"), "{e}");
    }

    /// Both ends' keys for `framing` and `algorithm` (0: AES-256-GCM, 1: ChaCha20-Poly1305; AES-128-GCM's
    /// 16-byte keys only rustls makes, and the tests against its server cover it): what one seals, the
    /// other opens.
    fn key_pair(framing: Framing, algorithm: u8, seq: u64) -> (Keys, Keys) {
        let secrets = |seed: u8| {
            let (key, iv) = ([seed; 32].into(), rustls::crypto::cipher::Iv::new([seed ^ 0x5a; 12]));
            match algorithm {
                0 => ConnectionTrafficSecrets::Aes256Gcm { key, iv },
                _ => ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv },
            }
        };
        let direction = |seed| Direction::new(secrets(seed), seq).unwrap();
        let ours = Keys { framing, rx: direction(1), tx: direction(2) };
        let theirs = Keys { framing, rx: direction(2), tx: direction(1) };
        (ours, theirs)
    }

    fn framing(pick: u8) -> Framing {
        match pick % 3 {
            0 => Framing::Tls13,
            1 => Framing::Tls12 { explicit: true },
            _ => Framing::Tls12 { explicit: false },
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Records of any sizes, sealed by one end and opened by the other as a read opens them, each
        /// plaintext written below its ciphertext: the plaintexts lie side by side, the bytes sealed, in
        /// every framing and algorithm (the reference: their concatenation).
        #[test]
        fn records_opened_below_their_ciphertext_lie_side_by_side(
            pick in 0u8..3,
            algorithm in 0u8..2,
            sizes in proptest::collection::vec(0usize..=MAX_PLAIN, 1..12),
            seq in 0u64..1 << 40,
        ) {
            let (mut ours, mut theirs) = key_pair(framing(pick), algorithm, seq);
            let mut wire = Vec::new();
            let mut sent = Vec::new();
            for (i, &size) in sizes.iter().enumerate() {
                let plain = pattern(size, i as u32);
                theirs.seal(APPLICATION_DATA, &plain, &mut wire).unwrap();
                sent.extend_from_slice(&plain);
            }
            let (mut at, mut to) = (0, 0);
            while let Some(len) = whole_record(&wire[at..]).unwrap() {
                let (kind, n) = ours.open(&mut wire, at, to).unwrap();
                prop_assert_eq!(kind, APPLICATION_DATA);
                at += HEADER + len;
                to += n;
            }
            prop_assert_eq!(at, wire.len());
            prop_assert_eq!(to, sent.len());
            prop_assert!(wire[..to] == sent[..], "the plaintexts differ");
        }

        /// Bytes that are no record sealed by the other end (any header, any body, or a sealed record
        /// with a byte changed): refused, never a panic, and never taken as plaintext.
        #[test]
        fn hostile_records_are_refused(
            pick in 0u8..3,
            algorithm in 0u8..2,
            kind in any::<u8>(),
            body in proptest::collection::vec(any::<u8>(), 0..600),
            size in 0usize..2000,
            flip in any::<prop::sample::Index>(),
        ) {
            let (mut ours, mut theirs) = key_pair(framing(pick), algorithm, 7);
            let mut record = vec![kind, 3, 3, (body.len() >> 8) as u8, body.len() as u8];
            record.extend_from_slice(&body);
            prop_assert_eq!(whole_record(&record).unwrap(), Some(body.len()));
            prop_assert!(ours.open(&mut record, 0, 0).is_err());
            let mut sealed = Vec::new();
            theirs.seal(APPLICATION_DATA, &pattern(size, 3), &mut sealed).unwrap();
            let i = flip.index(sealed.len() - HEADER) + HEADER;
            sealed[i] ^= 1;
            let (mut ours, _) = key_pair(framing(pick), algorithm, 7);
            prop_assert!(ours.open(&mut sealed, 0, 0).is_err());
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        /// Records of any size, read in reads of any sizes: the bytes are the server's, in order.
        #[test]
        fn records_of_any_size_read_in_any_reads_are_the_bytes_sent(
            fragment in 64usize..=16_389,
            len in 0usize..400_000,
            sizes in proptest::collection::vec(prop_oneof![1usize..64, 64usize..FAST_MIN, FAST_MIN..300_000], 1..8),
            tls12 in any::<bool>(),
        ) {
            let suite = if tls12 {
                cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
            } else {
                cipher_suite::TLS13_AES_128_GCM_SHA256
            };
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let cert = certificate();
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let send = pattern(len, len as u32);
            let script = Script { send: send.clone(), fragment: Some(fragment), ..Script::default() };
            let served = server(listener, suite, (cert.0.clone(), cert.1.clone_key()), script);
            let (got, end) = rt.block_on(async {
                let mut stream = client(addr, cert.0).await.unwrap();
                read_all(&mut stream, &sizes).await
            });
            served.join().unwrap();
            prop_assert!(end.is_ok(), "{:?}", end);
            prop_assert_eq!(got.len(), send.len());
            prop_assert!(got == send, "the bytes differ");
        }
    }
}
