//! Every `docs/PAGE.md#heading` that a source file, test or fixture note cites names a page of
//! `docs/` that exists and a heading on it, and nothing cites the specification files, which
//! the repository does not contain.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The anchor a heading gets on GitHub: lower case, punctuation other than `-` and `_`
/// dropped, spaces made dashes.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of every heading of a Markdown page (outside code blocks).
fn anchors(page: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in page.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let hashes = line.bytes().take_while(|&b| b == b'#').count();
        if (1..=6).contains(&hashes) && line.as_bytes().get(hashes) == Some(&b' ') {
            out.insert(anchor(&line[hashes + 1..]));
        }
    }
    out
}

/// Every text file under `dir`, recursively (binary fixtures are skipped).
fn text_files(dir: &Path, out: &mut Vec<(PathBuf, String)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            text_files(&path, out);
        } else if let Ok(text) = std::fs::read_to_string(&path) {
            out.push((path, text));
        }
    }
}

/// `(page, anchor)` for each `docs/NAME.md` or `docs/NAME.md#anchor` in `text`.
fn citations(text: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("docs/") {
        rest = &rest[at + "docs/".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
            .collect();
        let Some(page) = name.strip_suffix(".md").or_else(|| {
            // A sentence may end right after the page name.
            name.strip_suffix(".md.")
        }) else {
            continue;
        };
        let after = &rest[name.len()..];
        let anchor = after.strip_prefix('#').map(|a| {
            a.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
                .collect::<String>()
        });
        out.push((format!("{page}.md"), anchor));
    }
    out
}

#[test]
fn every_cited_docs_page_and_heading_exists() {
    let mut files = Vec::new();
    for dir in ["src", "tests", "benches"] {
        text_files(&Path::new(ROOT).join(dir), &mut files);
    }
    assert!(files.len() > 50, "only {} files found", files.len());
    let mut cited = 0;
    let mut problems = Vec::new();
    for (path, text) in &files {
        if path.ends_with("docs.rs") {
            continue;
        }
        let shown = path.strip_prefix(ROOT).unwrap_or(path).display();
        for (page, anchor) in citations(text) {
            cited += 1;
            let doc = Path::new(ROOT).join("docs").join(&page);
            let Ok(body) = std::fs::read_to_string(&doc) else {
                problems.push(format!("{shown}: docs/{page} does not exist"));
                continue;
            };
            if let Some(a) = anchor.filter(|a| !a.is_empty()) {
                if !anchors(&body).contains(&a) {
                    problems.push(format!("{shown}: docs/{page} has no heading #{a}"));
                }
            }
        }
        for spec in [
            "RUNTIME.md",
            "MODEL.md",
            "RELIABILITY.md",
            "RUNTIME §",
            "MODEL §",
        ] {
            if text.contains(spec) {
                problems.push(format!(
                    "{shown}: cites {spec}, which is not in the repository"
                ));
            }
        }
    }
    assert!(cited >= 30, "only {cited} citations of docs/ found");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn anchors_follow_the_heading_rules_the_citations_assume() {
    assert_eq!(anchor("config.json"), "configjson");
    assert_eq!(
        anchor("Latent MoE and the dense MLP"),
        "latent-moe-and-the-dense-mlp"
    );
    let page = "# Title\n\n## Exit codes\n\n```\n## not a heading\n```\n### `k3 run`\n";
    let found = anchors(page);
    assert!(found.contains("exit-codes") && found.contains("k3-run"));
    assert!(!found.contains("not-a-heading"));
    assert_eq!(
        citations("see docs/model.md#dimensions and docs/runtime.md."),
        vec![
            ("model.md".to_string(), Some("dimensions".to_string())),
            ("runtime.md".to_string(), None)
        ]
    );
}

#[test]
fn readme_links_every_docs_page() {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).expect("README.md");
    let mut pages = Vec::new();
    text_files(&Path::new(ROOT).join("docs"), &mut pages);
    assert!(!pages.is_empty());
    for (path, _) in pages {
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if !name.ends_with(".md") {
            continue;
        }
        assert!(
            readme.contains(&format!("docs/{name}")),
            "README.md does not link docs/{name}"
        );
    }
}
