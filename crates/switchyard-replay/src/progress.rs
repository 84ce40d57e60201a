//! Progress of long replays: a bar drawn in place when stderr is a terminal, and otherwise (a CI
//! log, `2> file`, a pipe) one plain line every few seconds with done/total and an ETA, so a
//! replay that runs for minutes never looks hung.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle, TermLike};
use parking_lot::Mutex;

/// How often a progress line is written when stderr is not a terminal.
pub const PROGRESS_LINE_INTERVAL: Duration = Duration::from_secs(5);

/// A progress bar over `len` requests on stderr: in place at a terminal, else a line every
/// [`PROGRESS_LINE_INTERVAL`].
pub fn progress_bar(len: Option<u64>, message: String) -> ProgressBar {
    if std::io::stderr().is_terminal() {
        let bar = new_bar(len);
        let template = match len {
            Some(_) => "{msg:>24} [{bar:40}] {pos}/{len} req {elapsed} (ETA {eta})",
            None => "{msg:>24} {pos} req {elapsed}",
        };
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(message);
        bar
    } else {
        progress_lines(
            len,
            message,
            Box::new(std::io::stderr()),
            PROGRESS_LINE_INTERVAL,
        )
    }
}

/// The bars of replays that run at the same time: at a terminal each keeps its own line (one
/// [`MultiProgress`] draws them all), elsewhere each writes its own spaced lines.
#[derive(Debug, Clone)]
pub struct ProgressGroup {
    multi: Option<MultiProgress>,
}

impl ProgressGroup {
    pub fn new() -> Self {
        Self {
            multi: std::io::stderr().is_terminal().then(MultiProgress::new),
        }
    }

    /// A [`progress_bar`] drawn with the group's other bars.
    pub fn bar(&self, len: Option<u64>, message: String) -> ProgressBar {
        let bar = progress_bar(len, message);
        match &self.multi {
            Some(multi) => multi.add(bar),
            None => bar,
        }
    }
}

impl Default for ProgressGroup {
    fn default() -> Self {
        Self::new()
    }
}

/// A progress bar that writes plain lines to `out`, at most one per `every` (the first draw
/// always).
pub fn progress_lines(
    len: Option<u64>,
    message: String,
    out: Box<dyn Write + Send>,
    every: Duration,
) -> ProgressBar {
    let bar = new_bar(len);
    let template = match len {
        Some(_) => "{msg}: {pos}/{len} requests ({percent}%), {elapsed} elapsed, ETA {eta}",
        None => "{msg}: {pos} requests, {elapsed} elapsed",
    };
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    // indicatif redraws at most once a second; the lines themselves are spaced further apart.
    let lines = ProgressLines {
        out: Arc::new(Mutex::new(out)),
        every,
        state: Mutex::new(LineState::default()),
    };
    bar.set_draw_target(ProgressDrawTarget::term_like_with_hz(Box::new(lines), 1));
    bar.set_message(message);
    bar
}

fn new_bar(len: Option<u64>) -> ProgressBar {
    match len {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::no_length(),
    }
}

/// A `TermLike` that turns indicatif's in-place redraws into spaced, plain lines: cursor moves
/// are ignored, the text of one redraw is collected and written on `flush` when it is due.
struct ProgressLines {
    out: Arc<Mutex<Box<dyn Write + Send>>>,
    every: Duration,
    state: Mutex<LineState>,
}

#[derive(Default)]
struct LineState {
    pending: String,
    last_written: Option<Instant>,
}

impl std::fmt::Debug for ProgressLines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProgressLines")
            .field("every", &self.every)
            .finish_non_exhaustive()
    }
}

impl TermLike for ProgressLines {
    fn width(&self) -> u16 {
        200
    }
    fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn write_line(&self, s: &str) -> std::io::Result<()> {
        self.write_str(s)
    }
    fn write_str(&self, s: &str) -> std::io::Result<()> {
        let mut state = self.state.lock();
        let text = s.trim_matches(|c| c == '\r' || c == '\n');
        if !text.trim().is_empty() {
            if !state.pending.is_empty() {
                state.pending.push(' ');
            }
            state.pending.push_str(text.trim_end());
        }
        Ok(())
    }
    fn clear_line(&self) -> std::io::Result<()> {
        self.state.lock().pending.clear();
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        let mut state = self.state.lock();
        let line = std::mem::take(&mut state.pending);
        let due = state
            .last_written
            .is_none_or(|at| at.elapsed() >= self.every);
        if line.is_empty() || !due {
            return Ok(());
        }
        state.last_written = Some(Instant::now());
        drop(state);
        let mut out = self.out.lock();
        writeln!(out, "{line}")?;
        out.flush()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    /// A writer the test reads back.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    impl Shared {
        fn lines(&self) -> Vec<String> {
            String::from_utf8(self.0.lock().clone())
                .unwrap()
                .lines()
                .map(str::to_owned)
                .collect()
        }
    }

    #[test]
    fn lines_carry_done_total_and_an_eta_without_escape_codes() {
        let out = Shared::default();
        let bar = progress_lines(
            Some(10),
            "kv c=4".into(),
            Box::new(out.clone()),
            Duration::ZERO,
        );
        bar.inc(3);
        bar.force_draw();
        bar.finish();
        let lines = out.lines();
        assert!(!lines.is_empty(), "no progress line written");
        let first = &lines[0];
        assert!(first.starts_with("kv c=4: "), "{first}");
        assert!(first.contains("/10 requests"), "{first}");
        assert!(first.contains("ETA "), "{first}");
        let last = lines.last().unwrap();
        assert!(last.contains("10/10 requests (100%)"), "{lines:?}");
        assert!(
            lines
                .iter()
                .all(|l| !l.contains('\u{1b}') && !l.contains('\r')),
            "{lines:?}"
        );
    }

    #[test]
    fn lines_are_spaced_by_the_interval() {
        let out = Shared::default();
        let bar = progress_lines(
            Some(1000),
            "rr".into(),
            Box::new(out.clone()),
            Duration::from_secs(3600),
        );
        for _ in 0..1000 {
            bar.inc(1);
            bar.force_draw();
        }
        bar.finish();
        assert_eq!(out.lines().len(), 1, "{:?}", out.lines());
    }

    #[test]
    fn an_unknown_length_counts_requests() {
        let out = Shared::default();
        let bar = progress_lines(None, "agentx".into(), Box::new(out.clone()), Duration::ZERO);
        bar.inc(7);
        bar.force_draw();
        assert!(
            out.lines()
                .iter()
                .any(|l| l == "agentx: 7 requests, 0s elapsed"),
            "{:?}",
            out.lines()
        );
    }
}
