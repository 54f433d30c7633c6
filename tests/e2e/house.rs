//! The house's measures (docs/DESIGN.md, "Measures"), checked on the sources as they are: no import circle
//! between the modules of a crate, no source file over 600 lines of code before its tests, no
//! process-global static in the server but its metrics, no `Result<_, String>` outside tests, and every
//! file with unsafe code in DESIGN.md's unsafe inventory.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crates' source folders, from the workspace's root.
const CRATES: &[&str] = &["src", "server/src", "mount-tool/src", "energy/src", "lab/src", "csi/src"];

/// Lines of code (neither blank nor a comment) a source file may have before its `#[cfg(test)]` module.
const MAX_LINES: usize = 600;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every `.rs` file below `dir`, sorted.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// A file's code before its unit tests (`#[cfg(test)]` at the start of a line), its line comments
/// removed (a `//` inside a string such as a URL cuts that line short: harmless here).
fn code(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .take_while(|l| !l.starts_with("#[cfg(test)]"))
        .map(|l| l.find("//").map_or(l, |i| &l[..i]).trim_end().to_owned())
        .filter(|l| !l.trim().is_empty())
        .collect()
}

/// The top-level module a file of a crate's `src` belongs to (`None`: the crate's root).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let first = file.strip_prefix(src).unwrap().components().next()?.as_os_str().to_string_lossy().into_owned();
    let name = first.trim_end_matches(".rs").to_owned();
    (!matches!(name.as_str(), "lib" | "main")).then_some(name)
}

/// The modules of the crate that `line` names through `crate::` paths, grouped imports included.
fn named(line: &str, into: &mut BTreeSet<String>) {
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    for (i, _) in line.match_indices("crate::") {
        let rest = &line[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            for part in group.split(['}', ',']) {
                into.insert(ident(part.trim()));
            }
        } else {
            into.insert(ident(rest));
        }
    }
}

/// Each top-level module of the crate in `src` and the modules it uses.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in sources(src) {
        let Some(module) = module_of(src, &file) else { continue };
        let mut uses = BTreeSet::new();
        // A grouped import may span lines: the file's code as one line.
        named(&code(&file).join(" "), &mut uses);
        graph.entry(module).or_default().extend(uses);
    }
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for (module, uses) in graph.iter_mut() {
        uses.retain(|u| u != module && modules.contains(u));
    }
    graph
}

/// A circle of `graph`, if it has one: the modules along it, the first again at the end.
fn circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        graph: &BTreeMap<String, BTreeSet<String>>,
        at: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|m| m == at) {
            let mut found = path[i..].to_vec();
            found.push(at.to_owned());
            return Some(found);
        }
        if done.contains(at) {
            return None;
        }
        path.push(at.to_owned());
        for next in &graph[at] {
            if let Some(found) = visit(graph, next, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(at.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|m| visit(graph, m, &mut Vec::new(), &mut done))
}

#[test]
fn the_circle_finder_finds_a_circle_and_only_one() {
    let g = |edges: &[(&str, &str)]| {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    assert_eq!(circle(&g(&[("a", "b"), ("b", "c"), ("a", "c")])), None);
    assert_eq!(circle(&g(&[("a", "b"), ("b", "c"), ("c", "a")])).unwrap(), ["a", "b", "c", "a"]);
    let mut uses = BTreeSet::new();
    named("use crate::{fs::{Fs, X}, sync::Arc}; let x = crate::plan::plan(u);", &mut uses);
    assert!(["fs", "sync", "plan"].iter().all(|m| uses.contains(*m)), "{uses:?}");
}

#[test]
fn no_crate_has_an_import_circle_between_its_modules() {
    for krate in CRATES {
        let graph = graph(&root().join(krate));
        assert!(graph.len() > 1 || *krate == "energy/src", "{krate}: no modules found");
        if let Some(found) = circle(&graph) {
            panic!("{krate}: the modules {} use each other in a circle", found.join(" -> "));
        }
    }
}

#[test]
fn no_source_file_has_over_600_lines_of_code_before_its_tests() {
    let mut over = Vec::new();
    for krate in CRATES {
        for file in sources(&root().join(krate)) {
            let n = code(&file).len();
            if n > MAX_LINES {
                over.push(format!("{} ({n})", file.strip_prefix(root()).unwrap().display()));
            }
        }
    }
    assert!(over.is_empty(), "over {MAX_LINES} lines of code before their tests: {over:?}");
}

#[test]
fn the_server_has_no_process_global_static_but_its_metrics() {
    let src = root().join("server/src");
    let mut found = Vec::new();
    for file in sources(&src) {
        if file.ends_with("metrics.rs") {
            continue;
        }
        for line in code(&file) {
            let item = line.trim_start().trim_start_matches("pub(crate) ").trim_start_matches("pub ");
            if item.starts_with("static ") || item.starts_with("thread_local!") {
                found.push(format!("{}: {}", file.strip_prefix(&src).unwrap().display(), line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "process-global state in the server: {found:?}");
}

#[test]
fn no_result_carries_its_error_as_a_string_outside_tests() {
    let mut found = Vec::new();
    for krate in CRATES {
        for file in sources(&root().join(krate)) {
            for line in code(&file) {
                if line.contains(", String>") && line.contains("Result<") {
                    found.push(format!("{}: {}", file.strip_prefix(root()).unwrap().display(), line.trim()));
                }
            }
        }
    }
    assert!(found.is_empty(), "errors as strings: {found:?}");
}

#[test]
fn every_file_with_unsafe_code_is_in_the_design_s_inventory() {
    let design = std::fs::read_to_string(root().join("docs/DESIGN.md")).unwrap();
    let mut missing = Vec::new();
    for krate in CRATES {
        let folder = krate.trim_end_matches("src").trim_end_matches('/');
        let row_start = match folder {
            "" => "| `src/` |".to_owned(),
            f => format!("| `{f}/` |"),
        };
        let row = design.lines().find(|l| l.starts_with(&row_start)).unwrap_or_else(|| panic!("no row {row_start}"));
        // The inventory: what the row says after it first speaks of unsafe code.
        let inventory = row.split_once("unsafe").map_or("", |(_, after)| after);
        let src = root().join(krate);
        for file in sources(&src) {
            let text = std::fs::read_to_string(&file).unwrap();
            if !["unsafe {", "unsafe fn", "unsafe impl"].iter().any(|u| text.contains(u)) {
                continue;
            }
            let module = file.strip_prefix(&src).unwrap().with_extension("");
            let module = module.to_string_lossy();
            if !inventory.contains(&format!("`{module}`")) {
                missing.push(format!("{krate}: {module}"));
            }
        }
    }
    assert!(missing.is_empty(), "files with unsafe code that DESIGN.md's inventory does not list: {missing:?}");
}
