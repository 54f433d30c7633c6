//! The `batchfs-csi` command line: the CSI node plugin (`batchfs-csi --endpoint unix:///csi/csi.sock
//! --node-id NAME`) and its holder (`batchfs-csi holder --socket PATH --program PATH`). See
//! docs/DEPLOYMENT.md.

use crate::plugin::PluginConfig;
use crate::runner::Runner;
use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::time::Duration;

/// batchfs-csi: mounts batchfs datasets into Kubernetes pods (a CSI node plugin).
#[derive(Debug, Parser)]
#[command(name = "batchfs-csi", version, about, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// The socket the kubelet calls: unix:///PATH
    #[arg(long, env = "CSI_ENDPOINT")]
    endpoint: Option<String>,
    /// This node's name (NodeGetInfo)
    #[arg(long, env = "NODE_ID")]
    node_id: Option<String>,
    /// Where the plugin keeps what it published (a record per target) and the volumes' tokens
    #[arg(long, default_value = "/var/lib/batchfs-csi")]
    state_dir: PathBuf,
    /// The holder that runs the mounts (unix:///PATH). Without it the plugin runs them itself: they
    /// outlive the plugin's process, not its container.
    #[arg(long)]
    holder: Option<String>,
    /// The batchfs program the mounts run [default: `batchfs` beside this program]
    #[arg(long)]
    program: Option<PathBuf>,
    /// Install --program at this path when it differs from what is there (the path the holder's
    /// --program names), and upgrade every published mount's worker to it
    #[arg(long, value_name = "PATH")]
    install_program: Option<PathBuf>,
    /// The longest a mount, unmount or upgrade may take
    #[arg(long, default_value = "120s", value_parser = batchfs::units::parse_positive_duration)]
    mount_timeout: Duration,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the holder: starts, unmounts and upgrades mounts when the plugin asks, from a container that
    /// outlives the plugin's (as the container's init it also reaps the mounts' orphaned processes).
    Holder {
        /// The socket the plugin asks on: a path, or unix:///PATH as the plugin's --holder names it
        #[arg(long, default_value = "/var/lib/batchfs-csi/holder.sock", value_parser = holder_socket)]
        socket: PathBuf,
        /// The batchfs program the mounts run (the plugin's --install-program)
        #[arg(long, default_value = "/var/lib/batchfs-csi/bin/batchfs")]
        program: PathBuf,
        /// The longest a mount, unmount or upgrade may take
        #[arg(long, default_value = "120s", value_parser = batchfs::units::parse_positive_duration)]
        mount_timeout: Duration,
    },
}

/// The holder's `--socket`: `unix:///PATH` as the plugin's `--holder` takes it, or a path (it made a
/// directory named `unix:`).
fn holder_socket(text: &str) -> Result<PathBuf> {
    crate::plugin::socket_path(text)
}

/// The plugin's endpoint and node id: both given, the node id not empty (CSI requires one, and an empty
/// `--node-id ""` or `NODE_ID=` was taken).
fn endpoint_and_node(endpoint: Option<String>, node_id: Option<String>) -> Result<(String, String)> {
    let (Some(endpoint), Some(node_id)) = (endpoint, node_id) else {
        bail!("batchfs-csi needs --endpoint unix:///PATH and --node-id NAME (or run `batchfs-csi holder`)");
    };
    if node_id.trim().is_empty() {
        bail!("--node-id (or NODE_ID) is empty: CSI requires this node's name (the pod's spec.nodeName)");
    }
    Ok((endpoint, node_id))
}

/// Whether `args` (the program's name first) are a command line `batchfs-csi` accepts: what the
/// deployment files' tests check their containers' arguments with.
pub fn check_args<I: IntoIterator<Item = String>>(args: I) -> Result<()> {
    Cli::try_parse_from(args).map(|_| ()).map_err(|e| anyhow::anyhow!("{e}"))
}

/// Entry point of the binary.
pub fn run() -> Result<()> {
    let cli = Cli::parse();
    if matches!(cli.command, Some(Command::Holder { .. })) {
        // Before any thread: as PID 1 this forks, and only the child returns.
        crate::holder::init();
    }
    batchfs::process::init_logs("info", None);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    match cli.command {
        Some(Command::Holder { socket, program, mount_timeout }) => {
            runtime.block_on(crate::holder::serve(&socket, program, mount_timeout))
        }
        None => {
            let (endpoint, node_id) = endpoint_and_node(cli.endpoint, cli.node_id)?;
            let program = match cli.program {
                Some(p) => p,
                None => std::env::current_exe()?.with_file_name("batchfs"),
            };
            let runner = match &cli.holder {
                Some(h) => Runner::Holder { socket: crate::plugin::socket_path(h)?, timeout: cli.mount_timeout },
                None => Runner::Local {
                    program: cli.install_program.clone().unwrap_or_else(|| program.clone()),
                    timeout: cli.mount_timeout,
                },
            };
            let install = cli.install_program.map(|to| (program, to));
            let config = PluginConfig { endpoint, node_id, state_dir: cli.state_dir, runner, install };
            runtime.block_on(crate::plugin::run(config))
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_command_lines_of_the_docs_parse_and_typos_do_not() {
        let args = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        super::check_args(args("batchfs-csi --endpoint unix:///csi/csi.sock --node-id n1")).unwrap();
        super::check_args(args("batchfs-csi holder --socket /run/h.sock --program /x/batchfs")).unwrap();
        assert!(super::check_args(args("batchfs-csi --endpont unix:///csi/csi.sock")).is_err());
        assert!(super::check_args(args("batchfs-csi --mount-timeout forever")).is_err());
    }

    /// The holder refuses what the plugin refuses: a zero `--mount-timeout`; and takes its socket as the
    /// plugin's `--holder` names it.
    #[test]
    fn the_holder_takes_what_the_plugin_takes() {
        use clap::Parser;
        let holder = |extra: &[&str]| {
            let cli = super::Cli::try_parse_from([&["batchfs-csi", "holder"][..], extra].concat())?;
            match cli.command {
                Some(super::Command::Holder { socket, mount_timeout, .. }) => {
                    Ok::<_, clap::Error>((socket, mount_timeout))
                }
                None => unreachable!(),
            }
        };
        for zero in ["0", "0s", "0ms"] {
            let e = holder(&["--mount-timeout", zero]).unwrap_err().to_string();
            assert!(e.contains("--mount-timeout"), "{zero}: {e}");
        }
        let (socket, _) = holder(&["--socket", "unix:///run/h.sock"]).unwrap();
        assert_eq!(socket, std::path::Path::new("/run/h.sock"));
        let (socket, timeout) = holder(&[]).unwrap();
        assert_eq!(socket, std::path::Path::new("/var/lib/batchfs-csi/holder.sock"));
        assert_eq!(timeout, super::Duration::from_secs(120));
        assert!(holder(&["--socket", "tcp://h:1"]).is_err());
    }

    /// CSI requires a node id: an empty one is refused, as a missing one is.
    #[test]
    fn an_empty_node_id_is_refused() {
        use clap::Parser;
        let node = |id: &str| {
            let cli = super::Cli::try_parse_from(["batchfs-csi", "--endpoint", "unix:///c.sock", "--node-id", id])?;
            super::endpoint_and_node(cli.endpoint, cli.node_id)
        };
        assert_eq!(node("n1").unwrap().1, "n1");
        for empty in ["", " "] {
            let e = node(empty).unwrap_err().to_string();
            assert!(e.contains("--node-id (or NODE_ID) is empty"), "{empty:?}: {e}");
        }
        assert!(super::endpoint_and_node(Some("unix:///c.sock".into()), None).is_err());
    }

    #[test]
    fn every_flag_is_documented() {
        use clap::CommandFactory;
        let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/CONFIGURATION.md")).unwrap();
        let section = &docs[docs.find("## batchfs-csi").expect("docs/CONFIGURATION.md has a batchfs-csi section")..];
        let command = super::Cli::command();
        let holder = command.find_subcommand("holder").unwrap();
        for arg in command.get_arguments().chain(holder.get_arguments()) {
            if let Some(long) = arg.get_long().filter(|l| !["help", "version"].contains(l)) {
                assert!(section.contains(&format!("`--{long}")), "docs/CONFIGURATION.md lacks --{long}");
            }
        }
    }
}
