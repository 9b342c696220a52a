/*
 * efabus libfabric shim: plain functions around libfabric's static inline
 * API, and flat structs of fixed-width fields that the Rust side mirrors.
 *
 * Every struct here is owned by efabus, not by libfabric: its layout does
 * not move when libfabric's own structs grow between 1.x and 2.x, and every
 * field is 8 bytes wide so the Rust mirror has no padding to get wrong.
 */
#ifndef EFABUS_SHIM_H
#define EFABUS_SHIM_H

#include <stddef.h>
#include <stdint.h>

struct fi_info;
struct fid_fabric;
struct fid_domain;
struct fid_av;
struct fid_cq;
struct fid_ep;
struct fid_mr;

/* What efabus asks fi_getinfo for. Strings may be NULL (unset). */
struct efabus_hints {
	uint64_t caps;
	uint64_t mode;
	uint64_t mr_mode;
	uint64_t domain_mode;
	uint64_t ep_type;
	uint64_t addr_format;
	uint64_t tx_msg_order;
	uint64_t rx_msg_order;
	uint64_t threading;
	uint64_t av_type;
	const char *prov_name;
	const char *domain_name;
	const char *fabric_name;
};

/*
 * One fi_info entry, flattened. Strings and byte arrays point into the
 * fi_info and live as long as it does. has_* fields are 0 when the
 * corresponding attribute pointer was NULL.
 */
struct efabus_info_view {
	/* top level */
	uint64_t caps;
	uint64_t mode;
	uint64_t addr_format;
	uint64_t src_addrlen;
	uint64_t dest_addrlen;
	const void *src_addr;
	const void *dest_addr;
	const void *handle;
	/* tx_attr */
	uint64_t has_tx;
	uint64_t tx_caps;
	uint64_t tx_mode;
	uint64_t tx_op_flags;
	uint64_t tx_msg_order;
	uint64_t tx_comp_order;
	uint64_t tx_inject_size;
	uint64_t tx_size;
	uint64_t tx_iov_limit;
	uint64_t tx_rma_iov_limit;
	uint64_t tx_tclass;
	/* rx_attr */
	uint64_t has_rx;
	uint64_t rx_caps;
	uint64_t rx_mode;
	uint64_t rx_op_flags;
	uint64_t rx_msg_order;
	uint64_t rx_comp_order;
	uint64_t rx_total_buffered_recv;
	uint64_t rx_size;
	uint64_t rx_iov_limit;
	/* ep_attr */
	uint64_t has_ep;
	uint64_t ep_type;
	uint64_t ep_protocol;
	uint64_t ep_protocol_version;
	uint64_t ep_max_msg_size;
	uint64_t ep_msg_prefix_size;
	uint64_t ep_max_order_raw_size;
	uint64_t ep_max_order_war_size;
	uint64_t ep_max_order_waw_size;
	uint64_t ep_mem_tag_format;
	uint64_t ep_tx_ctx_cnt;
	uint64_t ep_rx_ctx_cnt;
	uint64_t ep_auth_key_size;
	/* domain_attr */
	uint64_t has_domain;
	const void *dom_domain;
	const char *dom_name;
	uint64_t dom_threading;
	uint64_t dom_control_progress;
	uint64_t dom_data_progress;
	uint64_t dom_resource_mgmt;
	uint64_t dom_av_type;
	uint64_t dom_mr_mode;
	uint64_t dom_mr_key_size;
	uint64_t dom_cq_data_size;
	uint64_t dom_cq_cnt;
	uint64_t dom_ep_cnt;
	uint64_t dom_tx_ctx_cnt;
	uint64_t dom_rx_ctx_cnt;
	uint64_t dom_max_ep_tx_ctx;
	uint64_t dom_max_ep_rx_ctx;
	uint64_t dom_max_ep_stx_ctx;
	uint64_t dom_max_ep_srx_ctx;
	uint64_t dom_cntr_cnt;
	uint64_t dom_mr_iov_limit;
	uint64_t dom_caps;
	uint64_t dom_mode;
	uint64_t dom_auth_key_size;
	uint64_t dom_max_err_data;
	uint64_t dom_mr_cnt;
	uint64_t dom_tclass;
	/* fabric_attr */
	uint64_t has_fabric;
	const char *fab_name;
	const char *fab_prov_name;
	uint64_t fab_prov_version;
	uint64_t fab_api_version;
	/* nic (fid_nic) */
	uint64_t has_nic;
	uint64_t has_device;
	const char *dev_name;
	const char *dev_device_id;
	const char *dev_device_version;
	const char *dev_vendor_id;
	const char *dev_driver;
	const char *dev_firmware;
	uint64_t has_bus;
	uint64_t bus_type;
	uint64_t pci_domain_id;
	uint64_t pci_bus_id;
	uint64_t pci_device_id;
	uint64_t pci_function_id;
	uint64_t has_link;
	const char *link_address;
	uint64_t link_mtu;
	uint64_t link_speed;
	uint64_t link_state;
	const char *link_network_type;
};

/*
 * A completion, as read from a CQ opened with FI_CQ_FORMAT_DATA: `buf` says
 * where a message landed in a multi-receive buffer.
 */
struct efabus_completion {
	void *op_context;
	uint64_t flags;
	uint64_t len;
	void *buf;
	uint64_t data;
};

/* A CQ error entry with the provider's explanation already rendered. */
struct efabus_cq_error {
	void *op_context;
	uint64_t flags;
	uint64_t len;
	uint64_t olen;
	int64_t err;
	int64_t prov_errno;
	char prov_text[256];
};

/* Every libfabric constant the Rust side uses, for a check in tests. */
struct efabus_constant {
	const char *name;
	uint64_t value;
};

const struct efabus_constant *efabus_constants(size_t *count);

/* Loads libfabric if this is the first call: 0 when it is loaded, else
 * EFABUS_FI_NOT_FOUND (no file could be opened) or EFABUS_FI_TOO_OLD (the
 * file lacks a function efabus needs), and efabus_fi_load_error() says
 * why. efabus_runtime_version, efabus_strerror and efabus_getinfo load it
 * themselves; the functions taking an fi_info or fabric need one that
 * efabus_getinfo returned, so the library is loaded by then. */
#define EFABUS_FI_NOT_FOUND 1
#define EFABUS_FI_TOO_OLD 2
int efabus_fi_load(void);
const char *efabus_fi_load_error(void);
/* Whether libfabric is loaded, without loading it. */
int efabus_fi_is_loaded(void);

uint32_t efabus_runtime_version(void);
/* The version of the headers the shim was compiled with. */
uint32_t efabus_header_version(void);
/* The file libfabric was loaded from (NULL when it is not loaded, or is
 * part of the program). */
const char *efabus_fi_loaded_from(void);

/* Remove SIGINT/SIGTERM handlers installed when libfabric's dependencies
 * were loaded; returns how many were removed, or -1 on error. */
int efabus_reset_termination_signals(void);
/* _exit(2): end the process without running libfabric's destructor. */
void efabus_exit_at_once(int status);
uint32_t efabus_requested_version(void);
const char *efabus_strerror(int err);

int efabus_getinfo(const char *node, const char *service, uint64_t flags,
		   const struct efabus_hints *hints, struct fi_info **info);
void efabus_freeinfo(struct fi_info *info);
struct fi_info *efabus_info_next(const struct fi_info *info);
struct fi_info *efabus_dupinfo(const struct fi_info *info);
void efabus_info_view(const struct fi_info *info, struct efabus_info_view *view);
/* fi_tostr_r(FI_TYPE_INFO); returns the number of bytes written. */
size_t efabus_info_tostr(const struct fi_info *info, char *buf, size_t len);

int efabus_fabric(const struct fi_info *info, struct fid_fabric **fabric);
int efabus_fabric_close(struct fid_fabric *fabric);
int efabus_domain(struct fid_fabric *fabric, struct fi_info *info,
		  struct fid_domain **domain);
int efabus_domain_close(struct fid_domain *domain);

int efabus_av_open(struct fid_domain *domain, uint64_t type, uint64_t count,
		   struct fid_av **av);
int efabus_av_close(struct fid_av *av);
/* Inserts one address; returns 1 on success, <= 0 on failure. */
int efabus_av_insert(struct fid_av *av, const void *addr, uint64_t *fi_addr);
int efabus_av_remove(struct fid_av *av, uint64_t fi_addr);

/* A wait set with an fd (FI_WAIT_FD) that CQs may signal. */
int efabus_wait_open(struct fid_fabric *fabric, struct fid_wait **wait);
int efabus_wait_fd(struct fid_wait *wait, int *fd);
int efabus_wait_close(struct fid_wait *wait);
/* fi_trywait on one wait set: 0 when the caller may block on its fd. */
int efabus_trywait(struct fid_fabric *fabric, struct fid_wait *wait);
/* FI_CQ_FORMAT_DATA; signals `wait` when not NULL, else no wait object. */
int efabus_cq_open(struct fid_domain *domain, uint64_t size, struct fid_wait *wait,
		   struct fid_cq **cq);
int efabus_cq_close(struct fid_cq *cq);
/* Returns the number of entries read, -FI_EAGAIN, -FI_EAVAIL or an error. */
int64_t efabus_cq_read(struct fid_cq *cq, struct efabus_completion *buf, uint64_t count);
int64_t efabus_cq_readfrom(struct fid_cq *cq, struct efabus_completion *buf, uint64_t count,
			   uint64_t *src_addr);
/* Returns 1 when an error entry was read, 0 or -FI_EAGAIN when none. */
int64_t efabus_cq_readerr(struct fid_cq *cq, struct efabus_cq_error *out);

int efabus_endpoint(struct fid_domain *domain, struct fi_info *info,
		    struct fid_ep **ep);
int efabus_ep_close(struct fid_ep *ep);
int efabus_ep_bind_av(struct fid_ep *ep, struct fid_av *av);
int efabus_ep_bind_cq(struct fid_ep *ep, struct fid_cq *cq, uint64_t flags);
/* Sets FI_OPT_EFA_RNR_RETRY; the caller makes sure the endpoint is efa RDM. */
int efabus_ep_set_efa_rnr_retry(struct fid_ep *ep, uint64_t retry);
/* Sets FI_OPT_MIN_MULTI_RECV: a multi-receive buffer with less room is released. */
int efabus_ep_set_min_multi_recv(struct fid_ep *ep, uint64_t min);
int efabus_enable(struct fid_ep *ep);
int efabus_getname(struct fid_ep *ep, void *addr, uint64_t *addrlen);

int efabus_mr_reg(struct fid_domain *domain, const void *buf, uint64_t len,
		  uint64_t access, uint64_t requested_key, struct fid_mr **mr);
int efabus_mr_close(struct fid_mr *mr);
void *efabus_mr_desc(struct fid_mr *mr);
uint64_t efabus_mr_key(struct fid_mr *mr);

int64_t efabus_recv(struct fid_ep *ep, void *buf, uint64_t len, void *desc,
		    void *context);
/* fi_recvmsg with FI_MULTI_RECV: one buffer that many messages fill in turn. */
int64_t efabus_recv_multi(struct fid_ep *ep, void *buf, uint64_t len, void *desc,
			  void *context);
int64_t efabus_send(struct fid_ep *ep, const void *buf, uint64_t len, void *desc,
		    uint64_t dest, void *context);
int64_t efabus_inject(struct fid_ep *ep, const void *buf, uint64_t len,
		      uint64_t dest);
/* fi_read of len bytes at (addr, key) of src into buf. */
int64_t efabus_read(struct fid_ep *ep, void *buf, uint64_t len, void *desc,
		    uint64_t src, uint64_t addr, uint64_t key, void *context);
/* fi_sendv of two buffers, each with its descriptor (or NULL). */
int64_t efabus_send2(struct fid_ep *ep, const void *buf0, uint64_t len0,
		     void *desc0, const void *buf1, uint64_t len1, void *desc1,
		     uint64_t dest, void *context);

#endif
