"""The doctor's controlled experiments, on a job prepared exactly as `ember run` prepares one
(ember.train.job.prepare, in a scratch folder with its own ledger). Each changes one thing and
takes its two sides interleaved (A, B, A, B...), so load from other processes, which comes and
goes, falls on both:

    baseline     the real loop (ember.train.loop.train) on the recipe as written: whole
                 iterations, each the step, the checkpoint due after it, and the bookkeeping
    checkpoint   the real loop without checkpoints, its stretches alternating with the
                 baseline's (when the recipe's period is longer than a stretch: one checkpoint
                 a stretch against none, amortised over the period)          checkpoint.py
    contention   /proc during the baseline (load, other processes' CPU, steal, run-queue wait);
                 when it shows, train_step with fewer threads against the recipe's  contention.py
    input        train_step on the real input pipeline against one in-memory micro-batch
    loader       the input pipeline alone, nothing consuming: micro-batches per second  input.py
    sweep        train_step at each larger micro batch the memory plan says fits, against the
                 recipe's: forward and backward per sample                   sweep.py
    profile      torch.profiler over a few steps: the top operators          profile.py
    ddp          N processes on loopback (gloo), forked from one that imported torch once:
                 train_step under DDP against the bare model, and the all-reduce alone  ddp.py

Every experiment is an `Experiment` (protocol.py): a name, what it changes, and
`run(budget) -> Result`; runner.py runs them in turn (`run_all`), from a plain list.

When each stops (budget.py's `Stop`): when its share of the time left is spent, or, for those
that compare two sides, as soon as the 98% interval of the effect it measures is narrower than
PRECISION of the step, whichever comes first: more rounds would not change what the ranking
says, and the time saved goes to the experiments after it.

--budget bounds the whole command (ember.doctor.examine starts the clock). Every experiment's
cost is estimated from the first steps' measured time before it runs; one that does not fit
in its share of the time left is shortened or skipped, and `Skipped` says why. The baseline's
evidence reorders the rest (a step that waits for data measures the input first; other
processes on the cores, contention). Steps are counted against the deadline as they run, so
the bound holds to within one step; loading the model and the first steps, which nothing
measured beforehand, are stopped at the deadline (budget.hard_deadline).
"""
