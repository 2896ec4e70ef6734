import Foundation
import HSMSigner

/// The audiences Apple gives each JWS kind.
public enum JWSAudience {
    /// StoreKit 2 promotional offer (`Product.PurchaseOption.promotionalOffer(_:compactJWS:)`).
    public static let promotionalOffer = "promotional-offer"
    /// Introductory offer eligibility.
    public static let introductoryOfferEligibility = "introductory-offer-eligibility"
    /// Advanced Commerce in-app request.
    public static let advancedCommerce = "advanced-commerce-api"
    /// App Store Server API bearer token.
    public static let appStoreServerAPI = "appstoreconnect-v1"
}

extension SignerService {
    /// The four ES256 compact JWS endpoints. Claims follow Apple's names:
    /// `iss` (the key's issuer ID), `iat` (seconds), `aud`, `bid`, and for
    /// the StoreKit kinds `nonce` (fresh lowercase UUID v4) and no `exp`.
    func signJWS(_ route: Route, _ request: HTTPRequest, _ config: SignerConfiguration) throws(APIError) -> HTTPResponse {
        let now = AppleFields.nowMilliseconds() / 1000
        var claims: [String: ClaimValue]
        // What the audit_log line names besides the key, the bundle, the nonce and iat (left empty when audit_log is off).
        var audited: [(key: String, value: LogValue)] = []
        let bundleID: String
        let keyID: String?
        switch route {
        case .promotionalOfferV2:
            let fields = try read(request) { () throws(APIError) in try PromotionalOfferV2Request(body: request.body) }
            try checked { () throws(FieldError) in
                try AppleFields.checkIdentifier(fields.productID, field: "product_id")
                try AppleFields.checkIdentifier(fields.offerID, field: "offer_id")
                if let transactionID = fields.transactionID { try AppleFields.checkTransactionID(transactionID) }
            }
            (bundleID, keyID) = (fields.bundleID, fields.keyID)
            claims = ["aud": .string(JWSAudience.promotionalOffer), "productId": .string(fields.productID),
                      "offerIdentifier": .string(fields.offerID)]
            if let transactionID = fields.transactionID { claims["transactionId"] = .string(transactionID) }
            if config.auditLog {
                audited = [("product.id", .string(fields.productID)), ("offer.id", .string(fields.offerID))]
                if let transactionID = fields.transactionID { audited.append(("transaction.id", .string(transactionID))) }
            }
        case .introductoryOfferEligibility:
            let fields = try read(request) { () throws(APIError) in try IntroductoryOfferEligibilityRequest(body: request.body) }
            try checked { () throws(FieldError) in
                try AppleFields.checkIdentifier(fields.productID, field: "product_id")
                try AppleFields.checkTransactionID(fields.transactionID)
            }
            (bundleID, keyID) = (fields.bundleID, fields.keyID)
            claims = ["aud": .string(JWSAudience.introductoryOfferEligibility), "productId": .string(fields.productID),
                      "allowIntroductoryOffer": .bool(fields.allowIntroductoryOffer), "transactionId": .string(fields.transactionID)]
            if config.auditLog {
                audited = [("product.id", .string(fields.productID)), ("transaction.id", .string(fields.transactionID)),
                           ("allow_introductory_offer", .bool(fields.allowIntroductoryOffer))]
            }
        case .advancedCommerceRequest:
            // Only the Base64 leaves the slot: the values read (about 20 × the
            // body's size) are released before the request waits for the token.
            let encoded: String
            let requestBytes: Int
            (bundleID, keyID, encoded, requestBytes) = try read(request) { () throws(APIError) in
                let fields = try AdvancedCommerceSigningRequest(body: request.body)
                let json = Data(JSONValue.object(fields.request).compactJSON.utf8)
                return (fields.bundleID, fields.keyID, json.base64EncodedString(), json.count)
            }
            claims = ["aud": .string(JWSAudience.advancedCommerce), "request": .string(encoded)]
            if config.auditLog { audited = [("request.bytes", .int(Int64(requestBytes)))] }
        case .serverAPIToken:
            let fields = try read(request) { () throws(APIError) in try ServerAPITokenRequest(body: request.body) }
            return try serverAPIToken(fields, request, config, now: now)
        default:
            throw APIError(.notFound, "\(route.rawValue) is not a JWS endpoint")
        }
        try checked { () throws(FieldError) in try AppleFields.checkIdentifier(bundleID, field: "bundle_id") }
        let key = try resolveKey(bundleID: bundleID, keyID: keyID, peer: request.peer, config)
        let nonce = AppleFields.randomUUID()
        claims["iss"] = .string(try issuer(of: key, config))
        claims["iat"] = .integer(now)
        claims["bid"] = .string(bundleID)
        claims["nonce"] = .string(nonce)
        let input = try read(request) { () throws(APIError) in CompactJWS.signingInput(keyID: key.keyID, claims: claims) }
        claims = [:]  // only the signing input waits for the token (an Advanced Commerce request's is about 1.8 × its body)
        let signature = try signRaw(input, keyID: key.keyID, config)
        let response = try read(request) { () throws(APIError) in
            json(200, JWSResponse(jws: try assemble(input, signature), keyID: key.keyID, nonce: nonce))
        }
        if config.auditLog {
            try audit(request, keyID: key.keyID, bundleID: bundleID, signature: signature, audited + [("nonce", .string(nonce)), ("iat", .int(now))])
        }
        return response
    }

    /// The App Store Server API bearer token: `exp − iat` is `ttl_seconds`
    /// (1–3600; Apple refuses more than 60 minutes), and `iat` is backdated
    /// by `clock_skew_seconds`, at most half the TTL, so that a host clock
    /// slightly ahead of Apple's gives no future `iat` (a 401) and the token
    /// is still valid when it leaves. It carries the common claims of
    /// apple-signatures.md, a fresh `nonce` included (Apple's first version
    /// of the bearer-token claims listed one too).
    private func serverAPIToken(_ fields: ServerAPITokenRequest, _ request: HTTPRequest, _ config: SignerConfiguration, now: Int64) throws(APIError) -> HTTPResponse {
        try checked { () throws(FieldError) in try AppleFields.checkIdentifier(fields.bundleID, field: "bundle_id") }
        let key = try resolveKey(bundleID: fields.bundleID, keyID: fields.keyID, peer: request.peer, config)
        let ttl = Int64(fields.ttlSeconds ?? 300)
        let issuedAt = now - min(Int64(config.clockSkewSeconds), ttl / 2)
        let expiresAt = issuedAt + ttl
        let nonce = AppleFields.randomUUID()
        let claims: [String: ClaimValue] = [
            "iss": .string(try issuer(of: key, config)), "iat": .integer(issuedAt), "exp": .integer(expiresAt),
            "aud": .string(JWSAudience.appStoreServerAPI), "bid": .string(fields.bundleID),
            "nonce": .string(nonce),
        ]
        let input = CompactJWS.signingInput(keyID: key.keyID, claims: claims)
        let signature = try signRaw(input, keyID: key.keyID, config)
        let token = try assemble(input, signature)
        if config.auditLog {
            try audit(request, keyID: key.keyID, bundleID: fields.bundleID, signature: signature,
                      [("nonce", .string(nonce)), ("iat", .int(issuedAt)), ("exp", .int(expiresAt))])
        }
        return json(200, ServerAPITokenResponse(token: token, keyID: key.keyID, issuedAt: issuedAt, expiresAt: expiresAt))
    }

    private func issuer(of key: KeyConfiguration, _ config: SignerConfiguration) throws(APIError) -> String {
        guard let issuer = key.issuerID ?? config.issuerID else {
            throw APIError(.invalidField, "key \(key.keyID) has no issuer ID configured (issuer_id in signerd.json, from App Store Connect → Users and Access → Integrations); JWS kinds need one", field: "key_id")
        }
        return issuer
    }

    /// SHA-256 of the signing input, signed through the token: raw `r ‖ s`
    /// (verified with the public key first when `verify_before_return`).
    private func signRaw(_ input: String, keyID: String, _ config: SignerConfiguration) throws(APIError) -> [UInt8] {
        try sign(digest: SHA256.hash(Array(input.utf8)), keyID: keyID, config).raw
    }

    /// The compact JWS: `input` + "." + base64url of the 64-byte signature.
    private func assemble(_ input: String, _ signature: [UInt8]) throws(APIError) -> String {
        do {
            return try CompactJWS.assemble(signingInput: input, rawSignature: signature)
        } catch {
            throw APIError(.internalError, "the token returned a \(signature.count)-byte signature; ES256 needs 64")
        }
    }

    private func checked(_ body: () throws(FieldError) -> Void) throws(APIError) {
        do { try body() } catch { throw APIError(error) }
    }
}
