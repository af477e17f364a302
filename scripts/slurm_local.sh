#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for the tests and for trying the cluster
# profile without a site (Debian 12 / slurm-wlm 22.05; root; no systemd needed).
#
#   scripts/slurm_local.sh start   install if missing, write a one-node slurm.conf, start
#                                  munged, slurmctld and slurmd, wait until the node is idle
#   scripts/slurm_local.sh stop    stop the three daemons by the PIDs in their pid files
#   scripts/slurm_local.sh uninstall  stop, then purge the packages `start` installed (and
#                                  the files it wrote), leaving the machine as start found it
#   scripts/slurm_local.sh status  exit 0 if the node answers, print sinfo
#
# Left installed, SLURM's client makes every later `snakemake` call on this machine wait 10 s
# (the executor plugin's `scontrol show config` timeout, with no controller to answer), which is
# why the tests uninstall what they installed.
#
# Every wait is bounded (SLURM_LOCAL_TIMEOUT seconds, default 120) and fails loudly.
# SLURM_LOCAL_CPUS declares more CPUs than the machine has (default: as many as it has), so
# that short jobs which mostly wait on the scheduler can run side by side in tests.
set -euo pipefail

timeout_s=${SLURM_LOCAL_TIMEOUT:-120}
pid_files=(/run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid)
# what `start` installed, one package per line: `uninstall` purges exactly these
installed_list=/var/lib/slurm_local/installed-packages
# what `configure` writes, removed with the packages that use it
slurm_files=(/etc/slurm/slurm.conf /var/spool/slurmctld /var/spool/slurmd /var/log/slurm)
munge_files=(/etc/munge /run/munge /var/log/munge /var/lib/munge)

say() { printf 'slurm_local: %s\n' "$*" >&2; }
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# wait_for DESCRIPTION COMMAND...: retry COMMAND every 0.5 s until it succeeds or time runs out
wait_for() {
  local what=$1 deadline=$((SECONDS + timeout_s))
  shift
  until "$@" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      say "gave up after ${timeout_s}s waiting for $what"
      return 1
    fi
    sleep 0.5
  done
}

stop() {
  local file pid
  for file in "${pid_files[@]}"; do
    if alive "$file"; then
      pid=$(cat "$file")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
      kill -9 "$pid" 2>/dev/null || true
      say "stopped $(basename "$file" .pid) (pid $pid)"
    fi
    rm -f "$file"
  done
}

install() {
  if command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged; then
    return 0
  fi >/dev/null
  command -v apt-get >/dev/null || { say "SLURM is not installed and there is no apt-get"; exit 1; }
  say "installing slurmctld, slurmd, slurm-client and munge from Debian's packages"
  export DEBIAN_FRONTEND=noninteractive
  local before
  before=$(installed_packages)
  timeout "$((timeout_s * 3))" apt-get update -qq
  timeout "$((timeout_s * 3))" apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
  mkdir -p "$(dirname "$installed_list")"
  comm -13 <(printf '%s\n' "$before") <(installed_packages) >"$installed_list"
}

installed_packages() {
  dpkg-query -W -f='${db:Status-Status} ${binary:Package}\n' | awk '$1 == "installed" {print $2}' | sort
}

uninstall() {
  stop
  if [ ! -s "$installed_list" ]; then
    say "nothing to uninstall: SLURM was not installed by this script"
    return 0
  fi
  say "purging the $(wc -l <"$installed_list") packages start installed"
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2046  # one package name per word
  timeout "$((timeout_s * 3))" apt-get purge -y -qq $(cat "$installed_list") >/dev/null
  grep -qx 'slurmctld\(:.*\)\?' "$installed_list" && rm -rf "${slurm_files[@]}"
  grep -qx 'munge\(:.*\)\?' "$installed_list" && rm -rf "${munge_files[@]}"
  rm -rf "$(dirname "$installed_list")"
}

node_idle() {
  local state
  state=$(sinfo -h -n "$(hostname -s)" -o %T 2>/dev/null)
  case "$state" in
    idle* | mix* | alloc*) return 0 ;;
    down* | drain*) scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true ;;
  esac
  return 1
}

configure() {
  local host cpus mem
  host=$(hostname -s)
  cpus=${SLURM_LOCAL_CPUS:-$(nproc)}
  # slurmd refuses to register a node that claims more memory than it sees: leave 1 GiB
  mem=$(($(awk '/MemTotal/{print int($2/1024)}' /proc/meminfo) - 1024))
  mkdir -p /etc/munge /run/munge /var/log/munge /var/lib/munge
  [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
  chmod 700 /etc/munge
  chmod 400 /etc/munge/munge.key
  chmod 755 /run/munge
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
  chown slurm:slurm /var/spool/slurmctld /var/log/slurm
  cat >/etc/slurm/slurm.conf <<EOF
ClusterName=local
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# No slurmdbd: sacct cannot work, so Snakemake's plugin must poll with squeue, and squeue
# must still list finished jobs when it polls (MinJobAge >= 3 x the plugin's first wait).
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
ReturnToService=2
SlurmdTimeout=60
MpiDefault=none
# trust the CPU count below even where it exceeds the hardware (SLURM_LOCAL_CPUS)
SlurmdParameters=config_overrides
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP
# a second partition on the same node: the tests compare two partitions' runs
PartitionName=second Nodes=${host} MaxTime=INFINITE State=UP
EOF
}

start() {
  local started=$SECONDS
  install
  configure
  alive /run/munge/munged.pid || runuser -u munge -- /usr/sbin/munged
  wait_for "munge" bash -c 'munge -n </dev/null | unmunge'
  alive /run/slurmctld.pid || /usr/sbin/slurmctld
  wait_for "slurmctld" bash -c 'scontrol ping | grep -q UP'
  alive /run/slurmd.pid || /usr/sbin/slurmd -N "$(hostname -s)"
  wait_for "the node to become idle" node_idle
  sinfo >&2
  say "up after $((SECONDS - started))s"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  uninstall) uninstall ;;
  status) sinfo && node_idle ;;
  *)
    say "usage: $0 start|stop|uninstall|status"
    exit 2
    ;;
esac
