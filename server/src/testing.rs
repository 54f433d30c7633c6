//! A server of a generated dataset on a loopback port, for the other crates' tests (the `testing`
//! feature): the mount's and the lab's CLI tests start one each, as `tests/e2e` does with its own
//! fixtures.

use crate::catalog::{Catalog, Dataset};
use crate::config::ServerLimits;
use crate::{RunningServer, ServeOptions};
use batchfs::gen::{self, GenOptions};
use batchfs::index::SourceFormat;
use batchfs::source::{IndexOptions, NoProgress};

/// A running server of dataset `d`, stopped (and its data removed) on drop.
pub struct GeneratedServer {
    pub runtime: tokio::runtime::Runtime,
    running: Option<RunningServer>,
    _data: tempfile::TempDir,
    /// `http://127.0.0.1:PORT/d`.
    pub url: String,
}

impl Drop for GeneratedServer {
    fn drop(&mut self) {
        if let Some(s) = self.running.take() {
            self.runtime.block_on(s.shutdown());
        }
    }
}

/// Generates a TFRecord dataset of `samples` (8 shards, sizes around `mean_bytes`) and serves it as `d`,
/// asking for `token` if given.
pub fn serve_generated(samples: u32, mean_bytes: u64, token: Option<&str>) -> GeneratedServer {
    serve_generated_as(SourceFormat::Tfrecord, samples, mean_bytes, token)
}

/// Like [`serve_generated`], of a dataset in source format `format`.
pub fn serve_generated_as(format: SourceFormat, samples: u32, mean_bytes: u64, token: Option<&str>) -> GeneratedServer {
    let data = tempfile::tempdir().expect("a temporary directory");
    let options = GenOptions { format, samples, mean_bytes, shards: 8, classes: 4, seed: 2, ..Default::default() };
    gen::generate(&options, data.path()).expect("the dataset generates");
    let catalog = Catalog::default();
    let io = ServerLimits::default().io_policy();
    let dataset = Dataset::open("d", data.path(), None, &IndexOptions::default(), &NoProgress, io).expect("it opens");
    catalog.insert(dataset).expect("one dataset");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let serve = ServeOptions {
        listen: "127.0.0.1:0".parse().expect("an address"),
        tls: None,
        token: token.map(|t| t.as_bytes().to_vec()),
        limits: Default::default(),
    };
    let running = runtime.block_on(crate::start(catalog, serve)).expect("the server starts");
    let url = format!("http://127.0.0.1:{}/d", running.local_addr().port());
    GeneratedServer { runtime, running: Some(running), _data: data, url }
}
