# A TPU VM image with tpuboot, built by Packer on Google Compute Engine: Ubuntu 22.04 by default.
#
#   packer validate -var project_id=MY-PROJECT -var deb=./tpuboot_VERSION_all.deb tpuboot-image.pkr.hcl
#   packer build    -var project_id=MY-PROJECT -var deb=./tpuboot_VERSION_all.deb tpuboot-image.pkr.hcl
#
# Another system: -var source_image_family=... -var source_image_project=..., e.g. Ubuntu 24.04
# (ubuntu-2404-lts, ubuntu-os-cloud) or Debian 12 (debian-12, debian-cloud).
#
# The build VM is an ordinary VM (no TPU): tpuboot, once installed, runs no privileged container
# there. `tpuboot prepare-image` is the last provisioning step: it checks the image against its
# next boot (kernel command line, limits, udev rules, leftovers of the old procedure), pulls the
# vBar image into dockerd, removes this VM's state and stops tpuboot, so the captured disk boots
# clean on every TPU VM. It exits 1 when something must be fixed, which stops the build.
#
# Written for the Packer Debian 12 ships (1.6, googlecompute built in). Packer 1.7 and later load
# googlecompute as a plugin: add this block and run `packer init` first (1.6 refuses the block):
#   packer {
#     required_plugins {
#       googlecompute = { source = "github.com/hashicorp/googlecompute", version = ">= 1.1.0" }
#     }
#   }

variable "project_id" {
  type        = string
  description = "The GCP project that builds and keeps the image."
}

variable "zone" {
  type    = string
  default = "us-central1-a"
}

variable "deb" {
  type        = string
  description = "The tpuboot .deb to install (scripts/build-deb makes it)."
  default     = "tpuboot_all.deb"
}

variable "source_image_family" {
  type        = string
  description = "The image family the build VM starts from: Ubuntu 22.04 LTS (Cloud TPU's runtime images are Ubuntu 22.04 based)."
  default     = "ubuntu-2204-lts"
}

variable "source_image_project" {
  type        = string
  description = "The project that publishes source_image_family (debian-cloud for debian-12)."
  default     = "ubuntu-os-cloud"
}

variable "image_family" {
  type    = string
  default = "tpu-vm-tpuboot"
}

source "googlecompute" "tpu_vm" {
  project_id              = var.project_id
  zone                    = var.zone
  source_image_family     = var.source_image_family
  source_image_project_id = [var.source_image_project]
  machine_type            = "n2-standard-4"
  disk_size               = 50
  image_name              = "${var.image_family}-${formatdate("YYYYMMDDhhmmss", timestamp())}"
  image_family            = var.image_family
  image_description       = "TPU VM image with tpuboot"
  ssh_username            = "packer"
}

build {
  sources = ["source.googlecompute.tpu_vm"]

  provisioner "file" {
    source      = var.deb
    destination = "/tmp/tpuboot.deb"
  }

  provisioner "shell" {
    environment_vars = ["DEBIAN_FRONTEND=noninteractive"]
    inline = [
      # Ubuntu: some of tpuboot's Python libraries and docker.io are in universe (on already in
      # Ubuntu's cloud images; this makes sure). Debian has them in main.
      "if grep -qx 'ID=ubuntu' /etc/os-release; then sudo -E add-apt-repository -y universe; fi",
      "sudo -E apt-get update",
      # dockerd runs vBar on the TPU VMs; prepare-image pulls its image into this one (and fails
      # without dockerd).
      "sudo -E apt-get install -y docker.io /tmp/tpuboot.deb",
      "sudo tpuboot prepare-image",
      "rm -f /tmp/tpuboot.deb",
    ]
  }
}
