"""Every CUDA claim of autotune measured on a real card, into one JSON, under a wall-clock deadline.

    python -m benchmarks.gpu_evidence --out DIR [--state DIR] [--deadline SECONDS] [--sections a,b,...] [--cpu]

Sections run in order (passes.SECTIONS); the JSON (`DIR/gpu-evidence.json`) is rewritten after each
one, so a command killed midway keeps what it finished. A section already `measured` or `skipped`
in `--state` is not run again; a failed one is retried; one the deadline did not reach (or cut
short) stays `pending` and the same command goes on with it. Exit status: 0 every selected section
done, 3 some pending, 1 some failed, 2 a mistake in the command or no CUDA without --cpu.

`--cpu` runs the same sections on a tiny GPT-2 with MiB budgets, CUDA-only ones skipped, so that
the script is known to work before device minutes are spent on it (tests/benchmarks/test_gpu_evidence.py).
On the GPU machine: benchmarks/gpu_evidence.sh and docs/gpu-evidence.md.

The orchestrator never imports torch: everything that touches torch or the card runs in a child
process (a section's command, or one of the helpers (helpers.HELPERS) through `Run.helper`), in its
own process group, killed with its children when the deadline arrives. A helper_* function lives
beside the section that asks for it and imports torch inside itself, never at a module's top.

The modules, the machinery first:
    __main__         the command line: the arguments, the card, the state's first files, main()
    common           the files' names, exit statuses, margins, how a section ends (Skip, Pending, Failed)
    children         a child in a process group of its own, killed at the deadline with what it started
    invocation       Run: one command's directories, mode, deadline, log and document; how it starts children
    document         gpu-evidence.json: its header, the earlier one read back, its writing, the state's tarball
    schedule         the deadline and resume bookkeeping: which section runs, its record, the exit status
    passes           Section and SECTIONS: each section's seconds, passes and prerequisites, in order of value
    helpers          a helper child's entry (HELPERS by name)
then the sections, each module with its helpers:
    versions         versions (pass 1)
    search           readme_command (passes 1 and 2), and run_search, which the other searches are made of
    forum            forum_config (pass 1)
    estimates        estimator_vs_probe (pass 1)
    checks           cuda_facts and cuda_constants (pass 1), micro_checks (pass 3); check_helpers their children
    pytest_gpu       pytest_gpu (pass 1)
    run_speed        train_200_steps (passes 1 and 2), trainer_handoff (pass 2): the run against its probe
    probe_overhead   probe_overhead (pass 2)
    truth            truth (pass 2): the search's pick against the noise-proof ground truth
    fresh_probes     the child that probes a study's configs in fresh processes (truth, spread)
    spread           spread (pass 2)
    data_lengths     data_lengths (pass 3)
    eval_generation  eval_generation (pass 3)
    benchmark        benchmark (pass 3)
    liger            liger_allocator_search (pass 3)
"""
