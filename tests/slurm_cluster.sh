#!/bin/bash
# A real, one-node Slurm cluster on 127.0.0.1, for the remote backend's tests and benchmarks.
#
#   tests/slurm_cluster.sh install        Debian's munge, slurmctld, slurmd, slurm-client, slurmdbd and
#                                         mariadb-server (--no-install-recommends), and openssh-server for
#                                         the SSH target's test, when missing; root
#   tests/slurm_cluster.sh start DIR      munged, MariaDB, slurmdbd, slurmctld and slurmd, all state in
#                                         DIR, no systemd; prints SLURM_CONF=DIR/slurm.conf when ready
#   tests/slurm_cluster.sh stop DIR       stops the daemons started in DIR, by the PIDs they wrote there
#
# Facts this kind of machine taught (issue 14): munged wants its socket folder mode 755 and its key
# mode 600; slurmdbd.conf must be mode 600 and the cluster registered with `sacctmgr -i add cluster`;
# AccountingStoragePass=<munge socket> makes slurmctld reach slurmdbd through our (non-default) munge
# socket; cred_expire=10 (default 120 s) lets a requeued job start again within seconds; package
# scripts must not start services during the install (a temporary /usr/sbin/policy-rc.d exiting 101);
# sched_interval=2: a requeued job, once its BeginTime passed, otherwise waits for the main scheduling
# loop's default 60 s (measured here: requeue to restart 57 s, and 11 s with it).
set -euo pipefail

PACKAGES="munge slurmctld slurmd slurm-client slurmdbd mariadb-server openssh-server"
CLUSTER=ember

missing() {
    for p in munged slurmctld slurmd sbatch slurmdbd mariadbd mariadb-install-db sshd; do
        command -v "$p" >/dev/null 2>&1 || [ -x "/usr/sbin/$p" ] || { echo "$p"; return 0; }
    done
    return 1
}

install() {
    if ! missing >/dev/null; then return 0; fi
    if [ "$(id -u)" != 0 ]; then
        echo "Slurm is not installed ($(missing) missing) and installing it needs root" >&2
        return 3
    fi
    local rc=/usr/sbin/policy-rc.d placed=""
    if [ ! -e "$rc" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$rc" && chmod 755 "$rc" && placed=1
    fi
    trap '[ -z "$placed" ] || rm -f /usr/sbin/policy-rc.d' RETURN
    # Another apt-get may hold the dpkg lock (a shared machine): wait for it rather than fail.
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
        $PACKAGES >/dev/null
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# wait_for SECONDS DESCRIPTION COMMAND...: poll (bounded) until COMMAND succeeds
wait_for() {
    local seconds=$1 what=$2
    shift 2
    local i
    for ((i = 0; i < seconds * 5; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.2
    done
    echo "slurm_cluster: $what did not come up within ${seconds} s; logs in $DIR/log" >&2
    tail -n 20 "$DIR"/log/*.log >&2 || true
    return 1
}

start() {
    install
    mkdir -p "$DIR"/{munge,mysql,log,state,spool,run}
    DIR=$(cd "$DIR" && pwd)
    local node sock ctld_port slurmd_port dbd_port db_port mem
    node=$(hostname -s)
    sock="$DIR/munge/munge.socket.2"
    ctld_port=$(free_port); slurmd_port=$(free_port); dbd_port=$(free_port); db_port=$(free_port)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))

    # munge: its key (600) and its socket folder (755)
    chmod 755 "$DIR/munge"
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chmod 600 "$DIR/munge/munge.key"
    /usr/sbin/munged --force --key-file="$DIR/munge/munge.key" --socket="$sock" \
        --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/seed"
    wait_for 10 munged munge -S "$sock" -n

    # MariaDB, on a port of 127.0.0.1, with a user for slurmdbd
    mariadb-install-db --no-defaults --datadir="$DIR/mysql" --user=root --auth-root-authentication-method=normal \
        --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1
    (mariadbd --no-defaults --datadir="$DIR/mysql" --socket="$DIR/run/mysql.sock" --port="$db_port" \
        --bind-address=127.0.0.1 --user=root --pid-file="$DIR/run/mariadb.pid" --skip-name-resolve \
        --log-error="$DIR/log/mariadb.log" --innodb-buffer-pool-size=32M </dev/null >/dev/null 2>&1 &)
    wait_for 30 MariaDB mariadb --no-defaults -S "$DIR/run/mysql.sock" -u root -e 'SELECT 1'
    mariadb --no-defaults -S "$DIR/run/mysql.sock" -u root -e \
        "CREATE USER IF NOT EXISTS 'slurm'@'%' IDENTIFIED BY 'ember'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'%';"

    cat >"$DIR/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$sock
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$dbd_port
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$db_port
StorageUser=slurm
StoragePass=ember
StorageLoc=slurm_acct_db
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
EOF
    chmod 600 "$DIR/slurmdbd.conf"

    cat >"$DIR/slurm.conf" <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$sock,cred_expire=10
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
MailProg=/bin/true
JobRequeue=1
ReturnToService=2
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
KillWait=15
MinJobAge=600
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$dbd_port
AccountingStoragePass=$sock
NodeName=$node NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
    export SLURM_CONF="$DIR/slurm.conf"

    /usr/sbin/slurmdbd  # reads slurmdbd.conf beside $SLURM_CONF
    wait_for 30 slurmdbd sacctmgr -n list cluster
    sacctmgr -i add cluster "$CLUSTER" >/dev/null 2>&1 || true
    /usr/sbin/slurmctld -f "$DIR/slurm.conf"
    wait_for 30 slurmctld scontrol ping
    /usr/sbin/slurmd -f "$DIR/slurm.conf" -N "$node"
    idle() { sinfo -h -N -o %t | grep -qE '^(idle|mix|alloc)'; }
    wait_for 30 "slurmd (node idle)" idle
    echo "SLURM_CONF=$SLURM_CONF"
}

stop() {
    DIR=$(cd "$DIR" && pwd)
    local name pid i
    # Daemons in reverse order of their start; each by the PID it wrote into DIR.
    for name in slurmd slurmctld slurmdbd mariadb munged; do
        [ -s "$DIR/run/$name.pid" ] || continue
        pid=$(cat "$DIR/run/$name.pid")
        kill "$pid" 2>/dev/null || continue
        for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    done
}

case "${1:-}" in
    install) install ;;
    start) DIR=${2:?usage: $0 start DIR}; start ;;
    stop) DIR=${2:?usage: $0 stop DIR}; stop ;;
    *) echo "usage: $0 install | start DIR | stop DIR" >&2; exit 2 ;;
esac
