#!/bin/sh
# Host discovery for hvdlite-run --host-discovery-script: print one "host:slots" line per host
# that may run workers now. hvdlite-run runs this every second; the job grows and shrinks with
# its output. Replace the body with your cluster's query (a scheduler, a cloud API, Kubernetes).
#
# This one reads the file named by $HOSTS_FILE (default: hosts.txt beside this script), so you
# can add or remove hosts by editing that file while the job runs.
HOSTS_FILE=${HOSTS_FILE:-"$(dirname "$0")/hosts.txt"}
exec cat "$HOSTS_FILE"
