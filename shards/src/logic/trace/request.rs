//! One request's trace while it runs: its server span, the children
//! finished so far, the attempt under way and what the tail sampler
//! looks at. Kept in the request's scope; filled by the request path's
//! hooks ([`crate::runtime::request::spans`]).

use super::sampler::Notable;
use super::span::{Kind, Span};

/// Child spans kept per request at most (attempts, holds,
/// continuations): a request cannot make its trace grow without bound.
pub const MAX_CHILDREN: usize = 64;

/// One request's spans.
#[derive(Debug, Clone)]
pub struct RequestTrace {
    /// The head sampler's decision (what the agent was told).
    pub head: bool,
    /// The request's span.
    pub root: Span,
    /// Its finished children.
    pub done: Vec<Span>,
    /// The attempt under way.
    pub attempt: Option<Span>,
    /// What the tail sampler reads.
    pub notable: Notable,
}

impl RequestTrace {
    /// A trace whose request span is `root`.
    pub fn new(root: Span, head: bool) -> Self {
        RequestTrace {
            head,
            root,
            done: Vec::new(),
            attempt: None,
            notable: Notable::default(),
        }
    }

    /// A child of the request span, with ID `id`, started at `start`.
    pub fn child(&self, name: &str, kind: Kind, id: [u8; 8], start: u64) -> Span {
        Span::new(
            self.root.trace_id,
            id,
            Some(self.root.span_id),
            name,
            kind,
            start,
        )
    }

    /// Keep a finished child (beyond [`MAX_CHILDREN`], dropped).
    pub fn keep(&mut self, s: Span) {
        if self.done.len() < MAX_CHILDREN {
            self.done.push(s);
        }
    }

    /// Room for another child.
    pub fn has_room(&self) -> bool {
        self.done.len() < MAX_CHILDREN
    }

    /// All the spans, the request's last, once it ended at `end` (an
    /// attempt still open is closed as unfinished).
    pub fn into_spans(mut self, end: u64) -> Vec<Span> {
        if let Some(mut a) = self.attempt.take() {
            a.fail("unfinished");
            a.end(end);
            self.done.push(a);
        }
        self.root.end(end);
        self.done.push(self.root);
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_are_bounded_and_an_open_attempt_is_closed_as_unfinished() {
        let root = Span::new(
            [1; 16],
            [2; 8],
            None,
            "POST /v1/chat/completions",
            Kind::Server,
            10,
        );
        let mut t = RequestTrace::new(root, true);
        for i in 0..(MAX_CHILDREN + 10) {
            let c = t.child("x", Kind::Internal, [3; 8], i as u64);
            t.keep(c);
        }
        assert_eq!(t.done.len(), MAX_CHILDREN);
        assert!(!t.has_room());
        t.done.clear();
        t.attempt = Some(t.child("hivenet.attempt", Kind::Client, [4; 8], 20));
        let spans = t.into_spans(30);
        assert_eq!(spans.len(), 2);
        assert_eq!(spans[0].error.as_deref(), Some("unfinished"));
        assert_eq!(spans[0].parent, Some([2; 8]));
        assert_eq!(
            (spans[1].name.as_str(), spans[1].end),
            ("POST /v1/chat/completions", 30)
        );
    }
}
