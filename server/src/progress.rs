//! Indexing progress for the server's subcommands (`index`, `serve`, `demo`): a bar on a terminal, log
//! lines otherwise, for each dataset being indexed.

use crate::catalog::Catalog;
use batchfs::source::Progress;
use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Indexing progress: a bar on a terminal, a log line every few seconds otherwise.
pub struct IndexProgress<'a> {
    name: String,
    /// The catalog that shows this dataset's progress (`/healthz`), if any.
    catalog: Option<&'a Catalog>,
    bar: Option<indicatif::ProgressBar>,
    state: Mutex<(u64, u64, Instant)>,
}

impl<'a> IndexProgress<'a> {
    pub fn new(name: &str) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(0);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{prefix} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            bar.set_prefix(format!("indexing {name}"));
            bar
        });
        IndexProgress { name: name.to_owned(), catalog: None, bar, state: Mutex::new((0, 0, Instant::now())) }
    }

    /// Also records the progress in `catalog` (for a dataset it announced).
    pub fn reporting_to(mut self, catalog: &'a Catalog) -> Self {
        self.catalog = Some(catalog);
        self
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

impl Progress for IndexProgress<'_> {
    fn start(&self, total: u64, shards: usize) {
        if let Some(bar) = &self.bar {
            bar.set_length(total);
        }
        *self.state.lock().expect("progress") = (0, total, Instant::now());
        if let Some(c) = self.catalog {
            c.progress(&self.name, 0, total);
        }
        tracing::info!(dataset = %self.name, shards, bytes = total, "indexing");
    }

    fn advance(&self, bytes: u64) {
        let mut s = self.state.lock().expect("progress");
        s.0 += bytes;
        if let Some(c) = self.catalog {
            c.progress(&self.name, s.0, s.1);
        }
        if let Some(bar) = &self.bar {
            bar.inc(bytes);
            return;
        }
        if s.2.elapsed() >= Duration::from_secs(5) {
            s.2 = Instant::now();
            let percent = s.0 as f64 * 100.0 / s.1.max(1) as f64;
            tracing::info!(dataset = %self.name, done = s.0, total = s.1, "indexing: {percent:.0}%");
        }
    }
}
