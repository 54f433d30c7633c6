//! The latency lab's instrument, measured: `batchfs netem` adds the RTT it is asked for (within 1 ms or
//! 10 %) and caps throughput within 10 %, without reordering or changing a byte.

use batchfs_mount::cmd::netem::{start, Link};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// An echo server on loopback.
fn echo() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut conn) = conn else { return };
            std::thread::spawn(move || {
                let mut r = conn.try_clone().unwrap();
                let _ = std::io::copy(&mut r, &mut conn);
            });
        }
    });
    addr
}

/// (min, median) of the samples.
fn min_median(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (v[0], v[v.len() / 2])
}

fn measured_rtt_ms(rtt_ms: f64) -> (f64, f64) {
    let link = Link { one_way: Duration::from_secs_f64(rtt_ms / 2000.0), jitter: Duration::ZERO, rate: None };
    let netem = start("127.0.0.1:0".parse().unwrap(), echo(), link).unwrap();
    let mut s = TcpStream::connect(netem.addr).unwrap();
    s.set_nodelay(true).unwrap();
    let mut buf = [0u8; 8];
    let samples = (0..15)
        .map(|_| {
            let t = Instant::now();
            s.write_all(b"ping1234").unwrap();
            s.read_exact(&mut buf).unwrap();
            t.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    min_median(samples)
}

#[test]
fn rtt_is_within_a_millisecond_or_ten_percent() {
    for rtt in [1.0, 10.0, 30.0] {
        // The minimum, as ping reports it: a delay line adds exactly the RTT; a busy machine only adds more.
        let (got, median) = measured_rtt_ms(rtt);
        let tolerance = (rtt * 0.1).max(1.0);
        eprintln!("RTT {rtt} ms: measured min {got:.3} ms, median {median:.3} ms (15 pings)");
        assert!((got - rtt).abs() <= tolerance, "RTT {rtt} ms measured {got:.3} ms");
    }
}

#[test]
fn throughput_is_within_ten_percent_of_the_cap_and_bytes_keep_their_order() {
    let rate_mbit = 400.0;
    let link =
        Link { one_way: Duration::from_millis(5), jitter: Duration::from_millis(2), rate: Some(rate_mbit * 1e6 / 8.0) };
    let netem = start("127.0.0.1:0".parse().unwrap(), echo(), link).unwrap();
    let s = TcpStream::connect(netem.addr).unwrap();
    let total = 20 << 20; // 20 MiB at 400 Mbit/s: ~0.42 s each way, pipelined
    let mut w = s.try_clone().unwrap();
    let data: Vec<u8> = (0..total).map(|i| (i % 251) as u8).collect();
    let writer = std::thread::spawn(move || {
        w.write_all(&data).unwrap();
        w.shutdown(Shutdown::Write).unwrap();
    });
    let started = Instant::now();
    let mut got = Vec::with_capacity(total);
    (&s).read_to_end(&mut got).unwrap();
    let secs = started.elapsed().as_secs_f64();
    writer.join().unwrap();
    drop(s);
    assert_eq!(got.len(), total);
    assert!(got.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8), "bytes reordered or changed");
    let mbit = total as f64 * 8.0 / 1e6 / secs;
    eprintln!("{rate_mbit} Mbit/s cap: measured {mbit:.1} Mbit/s end to end (through both directions)");
    assert!((mbit / rate_mbit - 1.0).abs() <= 0.10, "{mbit:.1} Mbit/s through a {rate_mbit} Mbit/s link");
}

#[test]
fn the_cap_is_the_links_shared_by_all_connections() {
    let rate_mbit = 400.0;
    let link = Link { one_way: Duration::from_millis(1), jitter: Duration::ZERO, rate: Some(rate_mbit * 1e6 / 8.0) };
    let netem = start("127.0.0.1:0".parse().unwrap(), echo(), link).unwrap();
    let each = 8 << 20;
    let data: Vec<u8> = vec![7; each];
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..3 {
            let data = &data;
            let addr = netem.addr;
            s.spawn(move || {
                let conn = TcpStream::connect(addr).unwrap();
                let mut w = conn.try_clone().unwrap();
                let writer = std::thread::spawn({
                    let data = data.clone();
                    move || {
                        w.write_all(&data).unwrap();
                        w.shutdown(Shutdown::Write).unwrap();
                    }
                });
                let mut got = Vec::new();
                (&conn).read_to_end(&mut got).unwrap();
                writer.join().unwrap();
                assert_eq!(got.len(), each);
            });
        }
    });
    let mbit = (3 * each) as f64 * 8.0 / 1e6 / started.elapsed().as_secs_f64();
    eprintln!("3 connections through a {rate_mbit} Mbit/s link: {mbit:.1} Mbit/s together");
    assert!((mbit / rate_mbit - 1.0).abs() <= 0.10, "{mbit:.1} Mbit/s together through a {rate_mbit} Mbit/s link");
}
