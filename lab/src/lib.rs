//! batchfs's lab tools, kept out of the daemons (the `batchfs` mount runs as root; none of this is
//! compiled into it): `demo` (generate, serve, mount, read one epoch, report: the README's first
//! command), `bench` (read a tree as a loader does), `netem` (a delay-line and rate-cap TCP proxy for
//! loopback links, with faults), `energy` (a command's energy per sensor, idle baseline subtracted) and `floor`
//! (what a checked receive costs this machine at the least: the figure the daemon's CPU is measured against).

pub mod bench;
pub mod demo;
pub mod energy;
pub mod floor;
pub mod netem;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// batchfs-lab: the demo and the instruments of the latency lab.
#[derive(Debug, Parser)]
#[command(name = "batchfs-lab", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate a sample dataset, serve it, mount it, read one epoch, print a result table.
    Demo(demo::DemoArgs),
    /// Read every file under a path as a loader would; report throughput, read latency, time stalled.
    Bench(bench::BenchArgs),
    /// A TCP proxy that adds latency and caps throughput (user-space netem, for loopback links).
    Netem(netem::NetemArgs),
    /// Run a command and report the energy it used per sensor, idle baseline subtracted.
    Energy(energy::EnergyArgs),
    /// Measure this machine's floor of a checked receive: a loopback TCP receive and every CRC32C path.
    Floor(floor::FloorArgs),
}

fn init_tracing(default: &str) {
    batchfs::process::init_logs(default, None);
}

/// Entry point of the binary.
pub fn run() -> Result<()> {
    match Cli::parse().command {
        Command::Demo(args) => {
            init_tracing("warn");
            demo::run(args)
        }
        Command::Bench(args) => bench::run(args),
        Command::Netem(args) => {
            init_tracing("info");
            netem::run(args)
        }
        Command::Energy(args) => {
            init_tracing("warn");
            let code = energy::run(args)?;
            std::process::exit(code)
        }
        Command::Floor(args) => floor::run(args),
    }
}
