#!/usr/bin/env bash
# A one-machine Slurm cluster for trying (and testing) kvrun's array script:
# a controller and one compute node on this host, with every state file under
# one directory. Needs root and Debian's slurm-wlm and munge packages.
#
#   examples/slurm/local-cluster.sh start DIR   # writes DIR/slurm.conf, starts munged, slurmctld, slurmd
#   export SLURM_CONF=DIR/slurm.conf            # then sbatch / squeue / sinfo talk to it
#   examples/slurm/local-cluster.sh stop DIR    # stops the three daemons
#
# The node gets this machine's CPU count and memory; jobs run as the user who
# submits them. Nothing is installed system-wide except what munge needs
# (/etc/munge/munge.key, created if missing).
set -euo pipefail

cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then
  echo "usage: $0 start|stop DIR" >&2
  exit 2
fi

stop_pid() { # stop the daemon whose pid file is $1
  if [ -s "$1" ]; then
    local pid
    pid=$(cat "$1")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$1"
  fi
}

case "$cmd" in
start)
  for b in munged slurmctld slurmd sbatch; do
    command -v "$b" >/dev/null 2>&1 || PATH=$PATH:/usr/sbin
    command -v "$b" >/dev/null 2>&1 || { echo "$0: $b not found (apt-get install slurm-wlm munge)" >&2; exit 1; }
  done
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  mkdir -p "$dir/ctld" "$dir/d" "$dir/log" "$dir/munge"
  host=$(hostname -s)
  cpus=$(nproc)
  mem_mb=$(awk '/MemTotal/ { printf "%d", $2 / 1024 * 0.9 }' /proc/meminfo)
  cat >"$dir/slurm.conf" <<CONF
ClusterName=kvrun-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
SlurmctldPort=$((6817 + RANDOM % 1000))
SlurmdPort=$((7817 + RANDOM % 1000))
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/d
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
  [ -s /etc/munge/munge.key ] || { mkdir -p /etc/munge; dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; chmod 400 /etc/munge/munge.key; }
  munged --force --socket="$dir/munge/munge.socket" --pid-file="$dir/munged.pid" \
    --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"
  export SLURM_CONF="$dir/slurm.conf"
  slurmctld -f "$dir/slurm.conf"
  slurmd -f "$dir/slurm.conf"
  # wait until the node takes jobs
  for _ in $(seq 120); do
    state=$(sinfo -h -N -o '%t' 2>/dev/null | head -1 || true)
    case "$state" in idle|mix|alloc) echo "$0: cluster up (node $host, $cpus CPUs; SLURM_CONF=$dir/slurm.conf)"; exit 0 ;; esac
    sleep 0.5
  done
  echo "$0: the node did not come up; logs in $dir/log" >&2
  tail -n 20 "$dir"/log/*.log >&2 || true
  exit 1
  ;;
stop)
  [ -d "$dir" ] || exit 0
  stop_pid "$dir/slurmd.pid"
  stop_pid "$dir/slurmctld.pid"
  stop_pid "$dir/munged.pid"
  ;;
*)
  echo "usage: $0 start|stop DIR" >&2
  exit 2
  ;;
esac
