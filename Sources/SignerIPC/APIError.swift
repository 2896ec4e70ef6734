import HSMSigner

/// An error the API returns:
/// `{"error": {"code": "…", "message": "…", "field": "…"}}` with the HTTP
/// status that fits (API contract v1, "Errors").
public struct APIError: Error, Sendable, Equatable, CustomStringConvertible {
    /// Stable `snake_case` error codes, each with its HTTP status.
    public struct Code: RawRepresentable, Hashable, Sendable, CustomStringConvertible {
        /// The code as it appears in the error body, e.g. `invalid_field`.
        public var rawValue: String
        /// Makes a code from its spelling.
        public init(rawValue: String) { self.rawValue = rawValue }
        /// The raw value.
        public var description: String { rawValue }

        /// 400: the request's framing is ambiguous (RFC 9112 §6): two
        /// different `Content-Length` values, or `Content-Length` with
        /// `Transfer-Encoding`. The connection is closed after the answer.
        public static let badRequest = Code(rawValue: "bad_request")
        /// 400: the body is not one JSON object.
        public static let invalidJSON = Code(rawValue: "invalid_json")
        /// 400: a field has the wrong type or value.
        public static let invalidField = Code(rawValue: "invalid_field")
        /// 400: a required field is absent.
        public static let missingField = Code(rawValue: "missing_field")
        /// 400: the request has a field the endpoint does not know.
        public static let unknownField = Code(rawValue: "unknown_field")
        /// 404: the key ID is not configured or not on the token.
        public static let keyNotFound = Code(rawValue: "key_not_found")
        /// 403: the key may not sign for this bundle ID.
        public static let bundleNotAllowed = Code(rawValue: "bundle_not_allowed")
        /// 403: the caller's uid/gid is not allowed.
        public static let forbidden = Code(rawValue: "forbidden")
        /// 404: no such path.
        public static let notFound = Code(rawValue: "not_found")
        /// 405: the path exists, the method does not.
        public static let methodNotAllowed = Code(rawValue: "method_not_allowed")
        /// 413: the body is over the limit.
        public static let payloadTooLarge = Code(rawValue: "payload_too_large")
        /// 431: the request line and headers are over `max_header_bytes`
        /// (RFC 6585 §5). The connection is closed after the answer.
        public static let headersTooLarge = Code(rawValue: "headers_too_large")
        /// 415: the body is not `application/json`.
        public static let unsupportedMediaType = Code(rawValue: "unsupported_media_type")
        /// 429: the caller sends faster than its rate limit.
        public static let rateLimited = Code(rawValue: "rate_limited")
        /// 503: the HSM is unavailable; retry after `Retry-After` seconds.
        public static let hsmUnavailable = Code(rawValue: "hsm_unavailable")
        /// 503: `audit_log` is on and the signature's audit line could not
        /// be written (standard error full, closed or `/dev/null`), so the
        /// signature is not returned; retry after `Retry-After` seconds.
        public static let auditLogUnwritable = Code(rawValue: "audit_log_unwritable")
        /// 500: a bug, or a signature that did not verify (never returned).
        public static let internalError = Code(rawValue: "internal")

        /// The HTTP status of the code.
        public var status: Int {
            switch self {
            case .badRequest, .invalidJSON, .invalidField, .missingField, .unknownField: 400
            case .forbidden, .bundleNotAllowed: 403
            case .keyNotFound, .notFound: 404
            case .methodNotAllowed: 405
            case .payloadTooLarge: 413
            case .headersTooLarge: 431
            case .unsupportedMediaType: 415
            case .rateLimited: 429
            case .hsmUnavailable, .auditLogUnwritable: 503
            default: 500
            }
        }
    }

    /// The stable code.
    public var code: Code
    /// A sentence naming the field and what was expected.
    public var message: String
    /// The field at fault, when one field is.
    public var field: String?
    /// Seconds before a retry may succeed (sent as `Retry-After`).
    public var retryAfter: Int?
    /// For a number beyond what signerd reads, the number as the message
    /// quotes it, so that a request type can say its field's own range
    /// instead (``FieldReader/init(json:allowed:exactNumbers:integerRanges:)``).
    var numberSent: String?
    /// Whether the error says the key on the token is unusable (HSM
    /// `key_invalid`: not P-256, two private keys under one key ID, no
    /// public key object), so that `/v1/offers` answers each offer 7234
    /// ("no usable In-App Purchase key") instead of failing the batch.
    var keyUnusable = false

    /// Makes an error.
    /// - Parameters:
    ///   - code: the stable code (it fixes the HTTP status).
    ///   - message: the sentence for the caller.
    ///   - field: the field at fault.
    public init(_ code: Code, _ message: String, field: String? = nil) {
        self.code = code
        self.message = message
        self.field = field
    }

    /// The HTTP status.
    public var status: Int { code.status }

    /// The code, the field in parentheses when there is one, and the message,
    /// e.g. `invalid_field (timestamp): …`; for logs.
    public var description: String {
        "\(code)\(field.map { " (\($0))" } ?? ""): \(message)"
    }

    /// The JSON body: `{"error":{"code":…,"message":…,"field":…}}`.
    public var jsonBody: String {
        var out = "{\"error\":{\"code\":"
        Logger.appendJSONString(code.rawValue, to: &out)
        out += ",\"message\":"
        Logger.appendJSONString(message, to: &out)
        if let field {
            out += ",\"field\":"
            Logger.appendJSONString(field, to: &out)
        }
        out += "}}"
        return out
    }
}
