# The NUMA lab: tests/numa run inside a QEMU VM with 4 NUMA nodes (tests/lab/vm.py boots it).
# `make test` includes them when the VM can run here and skips them with the reason otherwise.
# The fleet lab (tests/systemd/test_fleet_lab.py) runs in a systemd container instead
# (tests/lab/container.py) and needs HAProxy installed on the host: the container has no network.
# Prerequisites (Debian, as root): $(LAB_APT_INSTALL)
LAB_APT_PACKAGES := qemu-system-x86 linux-image-amd64 busybox-static cpio haproxy systemd-container
LAB_APT_INSTALL := apt-get install -y $(LAB_APT_PACKAGES)

.PHONY: test-lab lab-deps lab-check

# Only the lab: boots one VM and runs every tests/numa test in it (about a minute or two).
test-lab: $(STAMP)
	$(BIN)/python -m pytest tests/lab -q -rs

# Install the VM's prerequisites (needs root and the Debian archive).
lab-deps:
	DEBIAN_FRONTEND=noninteractive $(LAB_APT_INSTALL)

# Say whether the lab VM and the fleet container can run here, and what is missing when not.
lab-check:
	$(BIN)/python tests/lab/vm.py --check
	$(BIN)/python -m tests.lab.container --check
