//! A scripted training run on a real `memfit_memory::Allocator`: parameters in setup, three steps of
//! data / forward / backward / optimizer for a small CNN (modules conv1, conv2, fc1, fc2), activations
//! made as temporaries then re-tagged (saved), the ReLU backwards writing their gradient into the saved
//! output's memory re-tagged as a temporary, Adam state created in the first optimizer step, an evaluation
//! pass, and an out-of-memory request under a 64 MiB capacity. Spans are recorded per op and module
//! on the timeline's clock, as the device records them.

#![allow(dead_code)]

use memfit_memory::{
    Allocation, Allocator, AllocatorConfig, Category, HostBackend, MetaBackend, Phase, Request, SegmentBackend,
};
use memfit_profile::{Recording, Span, SpanKind};
use std::collections::HashMap;

pub const MIB: u64 = 1 << 20;
pub const CAPACITY: u64 = 64 * MIB;
const MODULES: [&str; 6] = ["", "conv1", "conv2", "fc1", "fc2", "loss"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Host,
    Meta,
}

struct Script {
    allocator: Allocator,
    phase: Phase,
    module: u32,
    /// Open spans: (name, kind, module, start ns).
    open: Vec<(String, SpanKind, u32, u64)>,
    spans: Vec<Span>,
    tensors: HashMap<String, Allocation>,
    /// Simulated compute per op, so times on a computing device look like a run.
    pause: std::time::Duration,
}

impl Script {
    fn alloc(&mut self, name: &str, bytes: u64, category: Category, op: &'static str) {
        let request = Request { category, op, phase: self.phase, module: self.module };
        let allocation = self.allocator.allocate(bytes, request).expect("the script fits in its capacity");
        if let Some(old) = self.tensors.insert(name.to_string(), allocation) {
            self.allocator.free(old.id).unwrap();
        }
    }

    fn free(&mut self, name: &str) {
        let allocation = self.tensors.remove(name).unwrap_or_else(|| panic!("{name} is live"));
        self.allocator.free(allocation.id).unwrap();
    }

    /// Hands `from`'s block over to `to` under another category (a backward reusing a saved
    /// activation's memory for a gradient).
    fn reuse(&mut self, from: &str, to: &str, category: Category) {
        let allocation = self.tensors.remove(from).unwrap_or_else(|| panic!("{from} is live"));
        self.allocator.set_category(allocation.id, category).unwrap();
        assert!(self.tensors.insert(to.to_string(), allocation).is_none(), "{to} is not live");
    }

    fn retag(&mut self, name: &str, category: Category) {
        let id = self.tensors[name].id;
        self.allocator.set_category(id, category).unwrap();
    }

    fn now(&self) -> u64 {
        self.allocator.timeline().now_ns()
    }

    fn begin(&mut self, name: &str, kind: SpanKind) {
        let start = self.now();
        self.open.push((name.to_string(), kind, self.module, start));
    }

    fn end(&mut self) {
        let (name, kind, module, start_ns) = self.open.pop().expect("a span is open");
        let end_ns = self.now();
        self.spans.push(Span { name, kind, phase: self.phase, module, start_ns, end_ns });
    }

    /// An op: its allocations happen inside its span.
    fn op(&mut self, name: &'static str, body: impl FnOnce(&mut Script)) {
        self.begin(name, SpanKind::Op);
        body(self);
        std::thread::sleep(self.pause);
        self.end();
    }

    fn module(&mut self, id: u32, body: impl FnOnce(&mut Script)) {
        let outer = self.module;
        self.module = id;
        self.begin(&format!("{} {}", MODULES[id as usize], self.phase), SpanKind::Module);
        body(self);
        self.end();
        self.module = outer;
    }
}

/// Runs the script; `timeline_events` bounds the recorded events (to test truncation).
pub fn scripted_recording(backend: Backend, timeline_events: usize) -> Recording {
    scripted_run(backend, timeline_events, 3)
}

/// The script with `steps` training steps.
pub fn scripted_run(backend: Backend, timeline_events: usize, steps: usize) -> Recording {
    let segments: Box<dyn SegmentBackend> = match backend {
        Backend::Host => Box::new(HostBackend::default()),
        Backend::Meta => Box::new(MetaBackend),
    };
    let config = AllocatorConfig { capacity: Some(CAPACITY), timeline_events, ..AllocatorConfig::default() };
    let allocator = Allocator::new(segments, config);
    let mut s = Script {
        allocator,
        phase: Phase::Setup,
        module: 0,
        open: Vec::new(),
        spans: Vec::new(),
        tensors: HashMap::new(),
        pause: match backend {
            Backend::Host => std::time::Duration::from_micros(300),
            Backend::Meta => std::time::Duration::ZERO,
        },
    };
    use Category::*;

    // Parameters: (module, name, bytes).
    let params: [(u32, &str, u64); 8] = [
        (1, "conv1.weight", 32 * 9 * 4),
        (1, "conv1.bias", 32 * 4),
        (2, "conv2.weight", 64 * 32 * 9 * 4),
        (2, "conv2.bias", 64 * 4),
        (3, "fc1.weight", 128 * 3136 * 4),
        (3, "fc1.bias", 128 * 4),
        (4, "fc2.weight", 10 * 128 * 4),
        (4, "fc2.bias", 10 * 4),
    ];
    for &(module, name, bytes) in &params {
        s.module(module, |s| s.op("init", |s| s.alloc(name, bytes, Parameter, "init")));
    }

    let batch = 64u64;
    for step in 0..steps {
        s.phase = Phase::Data;
        s.op("to_device", |s| {
            s.alloc("x", batch * 28 * 28 * 4, Input, "to_device");
            s.alloc("y", batch * 8, Input, "to_device");
        });

        s.phase = Phase::Forward;
        s.module(1, |s| {
            s.op("conv2d", |s| {
                s.alloc("im2col1", batch * 9 * 784 * 4, Temporary, "im2col");
                s.alloc("c1", batch * 32 * 784 * 4, Temporary, "conv2d");
                s.free("im2col1");
                s.retag("c1", Activation);
            });
            s.op("relu", |s| {
                s.alloc("r1", batch * 32 * 784 * 4, Temporary, "relu");
                s.retag("r1", Activation);
            });
            s.op("max_pool2d", |s| {
                s.alloc("p1", batch * 32 * 196 * 4, Temporary, "max_pool2d");
                s.alloc("p1.idx", batch * 32 * 196 * 8, Activation, "max_pool2d");
                s.retag("p1", Activation);
            });
        });
        s.module(2, |s| {
            s.op("conv2d", |s| {
                s.alloc("im2col2", batch * 288 * 196 * 4, Temporary, "im2col");
                s.alloc("c2", batch * 64 * 196 * 4, Temporary, "conv2d");
                s.free("im2col2");
                s.retag("c2", Activation);
            });
            s.op("relu", |s| {
                s.alloc("r2", batch * 64 * 196 * 4, Temporary, "relu");
                s.retag("r2", Activation);
            });
            s.op("max_pool2d", |s| {
                s.alloc("p2", batch * 64 * 49 * 4, Temporary, "max_pool2d");
                s.alloc("p2.idx", batch * 64 * 49 * 8, Activation, "max_pool2d");
                s.retag("p2", Activation);
            });
        });
        s.module(3, |s| {
            s.op("linear", |s| {
                s.alloc("f1", batch * 128 * 4, Temporary, "linear");
                s.retag("f1", Activation);
            });
            s.op("relu", |s| {
                s.alloc("fr1", batch * 128 * 4, Temporary, "relu");
                s.retag("fr1", Activation);
            });
        });
        s.module(4, |s| s.op("linear", |s| s.alloc("logits", batch * 10 * 4, Activation, "linear")));
        s.module(5, |s| {
            s.op("cross_entropy", |s| {
                s.alloc("probs", batch * 10 * 4, Activation, "log_softmax");
                s.alloc("loss", 4, Temporary, "cross_entropy");
            })
        });

        s.phase = Phase::Backward;
        let grad = |s: &mut Script, name: &str, bytes: u64| {
            if step == 0 {
                s.alloc(&format!("{name}.grad"), bytes, Gradient, "accumulate_grad");
            }
        };
        s.module(5, |s| {
            s.op("cross_entropy_backward", |s| {
                s.alloc("g_logits", batch * 10 * 4, Temporary, "cross_entropy_backward");
                s.free("probs");
                s.free("loss");
            })
        });
        s.module(4, |s| {
            s.op("linear_backward", |s| {
                s.alloc("g_fr1", batch * 128 * 4, Temporary, "linear_backward");
                grad(s, "fc2.weight", 10 * 128 * 4);
                grad(s, "fc2.bias", 10 * 4);
                s.free("g_logits");
                s.free("logits");
            })
        });
        s.module(3, |s| {
            s.op("relu_backward", |s| {
                s.alloc("g_f1", batch * 128 * 4, Temporary, "relu_backward");
                s.free("g_fr1");
                s.free("fr1");
            });
            s.op("linear_backward", |s| {
                s.alloc("g_p2", batch * 64 * 49 * 4, Temporary, "linear_backward");
                grad(s, "fc1.weight", 128 * 3136 * 4);
                grad(s, "fc1.bias", 128 * 4);
                s.free("g_f1");
                s.free("f1");
            });
        });
        s.module(2, |s| {
            s.op("max_pool2d_backward", |s| {
                s.alloc("g_r2", batch * 64 * 196 * 4, Temporary, "max_pool2d_backward");
                s.free("g_p2");
                s.free("p2");
                s.free("p2.idx");
            });
            s.op("relu_backward", |s| {
                // The gradient goes into the saved output's memory, re-tagged.
                s.reuse("r2", "g_c2", Temporary);
                s.free("g_r2");
            });
            s.op("conv2d_backward", |s| {
                s.alloc("cols2", batch * 288 * 196 * 4, Temporary, "im2col");
                s.alloc("g_p1", batch * 32 * 196 * 4, Temporary, "conv2d_backward");
                grad(s, "conv2.weight", 64 * 32 * 9 * 4);
                grad(s, "conv2.bias", 64 * 4);
                s.free("cols2");
                s.free("g_c2");
                s.free("c2");
            });
        });
        s.module(1, |s| {
            s.op("max_pool2d_backward", |s| {
                s.alloc("g_r1", batch * 32 * 784 * 4, Temporary, "max_pool2d_backward");
                s.free("g_p1");
                s.free("p1");
                s.free("p1.idx");
            });
            s.op("relu_backward", |s| {
                s.reuse("r1", "g_c1", Temporary);
                s.free("g_r1");
            });
            s.op("conv2d_backward", |s| {
                s.alloc("cols1", batch * 9 * 784 * 4, Temporary, "im2col");
                grad(s, "conv1.weight", 32 * 9 * 4);
                grad(s, "conv1.bias", 32 * 4);
                s.free("cols1");
                s.free("g_c1");
                s.free("c1");
            });
        });

        s.phase = Phase::Optimizer;
        for &(module, name, bytes) in &params {
            s.module(module, |s| {
                s.op("adam", |s| {
                    if step == 0 {
                        s.alloc(&format!("{name}.exp_avg"), bytes, OptimizerState, "adam");
                        s.alloc(&format!("{name}.exp_avg_sq"), bytes, OptimizerState, "adam");
                    }
                    s.alloc("update", bytes, Temporary, "adam");
                    s.free("update");
                })
            });
        }
        s.free("x");
        s.free("y");
    }

    // Evaluation: no saved activations; one request far beyond the capacity fails.
    s.phase = Phase::Eval;
    s.op("to_device", |s| s.alloc("x", batch * 28 * 28 * 4, Input, "to_device"));
    s.module(1, |s| {
        s.op("conv2d", |s| {
            s.alloc("im2col1", batch * 9 * 784 * 4, Temporary, "im2col");
            s.alloc("c1", batch * 32 * 784 * 4, Temporary, "conv2d");
            s.free("im2col1");
            let request = Request { category: Temporary, op: "conv2d", phase: Phase::Eval, module: 1 };
            assert!(s.allocator.allocate(100 * MIB, request).is_err(), "100 MiB cannot fit in 64 MiB");
            s.free("c1");
        })
    });
    s.free("x");

    finish(s)
}

fn finish(s: Script) -> Recording {
    let mut recording = Recording::from_allocator(
        "scripted simplecnn, batch 64, training steps and an evaluation".to_string(),
        if s.allocator.holds_data() { "cpu" } else { "meta" },
        &s.allocator,
    );
    recording.modules = MODULES.iter().map(|m| m.to_string()).collect();
    recording.spans = s.spans;
    recording
}
