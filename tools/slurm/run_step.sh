#!/usr/bin/env bash
# Sourced by the sbatch scripts beside it: `run_step CMD...` runs CMD as a job step (srun, one task
# per node) and requeues the job when SLURM signals it.
#
# The scripts ask for `#SBATCH --signal=B:USR1@180`: 180 s before the time limit SLURM sends SIGUSR1
# to this batch shell only. The trap forwards it to srun as SIGTERM; srun passes it to its tasks,
# torchrun (or Accelerate, or detectron2's launcher) passes it to the training processes, which
# finish their step, write a checkpoint and exit (docs/failsafe.md). Then the job is requeued
# (`#SBATCH --requeue`): it starts again with the same SLURM_JOB_ID and arguments, and
# `train.resume=auto` (pretraining) or `--resume` (detection) continues from that checkpoint. A
# preemption (SIGTERM to the whole job) takes the same path.
set -uo pipefail
# torchrun waits this long for its workers to save after passing the signal on, then kills them
# (its default is 30 s): keep it below the --signal lead time.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-150}

run_step() {
  # step is set empty, not left unset: a signal that comes before `step=$!` must not stop the
  # script on an unbound variable (set -u) before it requeues. Such a signal is remembered and
  # forwarded once the step exists.
  local signalled=0 rc step=""
  trap 'signalled=1; [ -z "$step" ] || kill -TERM "$step" 2>/dev/null' USR1 TERM
  srun --ntasks-per-node 1 --kill-on-bad-exit=1 "$@" &
  step=$!
  if [ "$signalled" = 1 ]; then
    kill -TERM "$step" 2>/dev/null
  fi
  wait "$step"; rc=$?
  while kill -0 "$step" 2>/dev/null; do  # a trapped signal ends `wait` early: wait for the step itself
    wait "$step"; rc=$?
  done
  trap - USR1 TERM
  if [ "$signalled" = 1 ]; then
    echo "$(date -Is) signalled: step exited with $rc; requeueing job ${SLURM_JOB_ID}" >&2
    scontrol requeue "${SLURM_JOB_ID}"
    exit 0
  fi
  return "$rc"
}
