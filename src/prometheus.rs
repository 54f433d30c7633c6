//! The Prometheus text exposition format (0.0.4), written once for the server's and the mount's
//! `/metrics`: families with their `HELP` and `TYPE` lines, samples with labels, label values escaped.

use std::fmt::{Display, Write as _};

/// A metrics page being written.
#[derive(Debug, Default)]
pub struct Exposition {
    text: String,
}

impl Exposition {
    pub fn new() -> Self {
        Exposition::default()
    }

    /// Starts the family `name` of `kind` (`counter`, `gauge`, `histogram`): its `HELP` and `TYPE`.
    pub fn family(&mut self, name: &str, kind: &str, help: &str) -> &mut Self {
        let _ = writeln!(self.text, "# HELP {name} {help}\n# TYPE {name} {kind}");
        self
    }

    /// One sample of the family being written: `name{labels} value` (`name` may carry a suffix such as
    /// `_bucket`).
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl Display) -> &mut Self {
        self.text.push_str(name);
        if !labels.is_empty() {
            self.text.push('{');
            for (i, (key, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.text.push(',');
                }
                let _ = write!(self.text, "{key}=\"{}\"", escape(v));
            }
            self.text.push('}');
        }
        let _ = writeln!(self.text, " {value}");
        self
    }

    /// A family of one unlabelled sample.
    pub fn metric(&mut self, name: &str, kind: &str, help: &str, value: impl Display) -> &mut Self {
        self.family(name, kind, help).sample(name, &[], value)
    }

    /// The page.
    pub fn finish(self) -> String {
        self.text
    }
}

/// A label value as the format writes it: backslash, double quote and newline escaped.
fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_samples_and_escaped_labels() {
        let mut e = Exposition::new();
        e.metric("a_total", "counter", "As counted.", 3);
        e.family("b", "gauge", "Bs.").sample("b", &[("server", "http://x\"y\\z")], 1.5).sample("b", &[], 2);
        e.sample("b_bucket", &[("le", "+Inf"), ("k", "v")], 7);
        assert_eq!(
            e.finish(),
            "# HELP a_total As counted.\n# TYPE a_total counter\na_total 3\n# HELP b Bs.\n# TYPE b gauge\n\
             b{server=\"http://x\\\"y\\\\z\"} 1.5\nb 2\nb_bucket{le=\"+Inf\",k=\"v\"} 7\n"
        );
    }
}
